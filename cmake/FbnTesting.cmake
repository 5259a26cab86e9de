# Helpers for fbn's test suites (tests/cc): GoogleTest executables and the consumer tests.
include(GoogleTest)
find_package(GTest REQUIRED)

# fbn_add_gtest(<target> <sources>... [LABELS <label>...])
# A GoogleTest executable linked to fbn and the test support library, with fbn's warning and
# sanitizer flags, registered test by test with ctest.
function(fbn_add_gtest target)
  cmake_parse_arguments(ARG "" "" "LABELS" ${ARGN})
  add_executable(${target} ${ARG_UNPARSED_ARGUMENTS})
  target_link_libraries(${target} PRIVATE fbn_test_support fbn::fbn GTest::gtest_main)
  fbn_apply_flags(${target})
  # A deadlock must fail the test, not stall CI.
  set(props LABELS "unit;${ARG_LABELS}" TIMEOUT 300)
  gtest_discover_tests(${target} DISCOVERY_TIMEOUT 120 PROPERTIES ${props})
endfunction()

# Consumer tests: tests/consumer built against fbn as a client would use it, by a cmake -P script
# (tests/consumer/run_consumer.cmake) that runs at ctest time, after fbn is built.
#   fbn_consumer_find_package   cmake --install into a temporary prefix, then find_package(fbn)
#   fbn_consumer_build_tree     find_package(fbn) from this build tree (its export())
#   fbn_consumer_add_subdirectory  add_subdirectory(<fbn source>) (builds fbn again)
function(fbn_add_consumer_tests)
  set(script ${PROJECT_SOURCE_DIR}/tests/consumer/run_consumer.cmake)
  # A sanitized libfbn.a needs the sanitizer runtime when the consumer links.
  string(REPLACE ";" "," sanitize "${FBN_SANITIZE}")
  set(build_type "${CMAKE_BUILD_TYPE}")
  if(NOT build_type)
    set(build_type Release)
  endif()
  set(common
      -DFBN_SOURCE_DIR=${PROJECT_SOURCE_DIR}
      -DFBN_BUILD_DIR=${PROJECT_BINARY_DIR}
      -DCXX=${CMAKE_CXX_COMPILER}
      -DGENERATOR=${CMAKE_GENERATOR}
      -DBUILD_TYPE=${build_type}
      -DSANITIZE=${sanitize})
  set(modes subdirectory)
  if(FBN_INSTALL)
    list(PREPEND modes find_package build_tree)
  endif()
  foreach(mode IN LISTS modes)
    add_test(NAME fbn_consumer_${mode}
             COMMAND ${CMAKE_COMMAND} ${common} -DMODE=${mode}
                     -DWORK_DIR=${CMAKE_CURRENT_BINARY_DIR}/consumer_${mode} -P ${script})
    set_tests_properties(fbn_consumer_${mode} PROPERTIES LABELS consumer TIMEOUT 900)
  endforeach()
endfunction()
