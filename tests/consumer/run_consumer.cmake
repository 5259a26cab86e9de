# Builds and runs tests/consumer against fbn, as ctest's fbn_consumer_* tests. Usage:
#   cmake -DMODE=find_package|build_tree|subdirectory -DFBN_SOURCE_DIR=<src> -DFBN_BUILD_DIR=<build>
#         -DWORK_DIR=<scratch> -DCXX=<compiler> -DGENERATOR=<gen> -DBUILD_TYPE=<type>
#         [-DSANITIZE=address,undefined] -P run_consumer.cmake
cmake_minimum_required(VERSION 3.18)

foreach(var MODE FBN_SOURCE_DIR FBN_BUILD_DIR WORK_DIR CXX GENERATOR BUILD_TYPE)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  list(JOIN ARGN " " command_line)
  message(STATUS "$ ${command_line}\n${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed with ${rc}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(args -S "${FBN_SOURCE_DIR}/tests/consumer" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    # Only what this test points at may be found: no user or system package registries.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(SANITIZE)
  list(APPEND args "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=${SANITIZE}")
endif()

if(MODE STREQUAL "find_package")
  run("${CMAKE_COMMAND}" --install "${FBN_BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
  list(APPEND args -DFBN_CONSUMER_MODE=package "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
  set(expect_dir "${WORK_DIR}/prefix")
elseif(MODE STREQUAL "build_tree")
  list(APPEND args -DFBN_CONSUMER_MODE=package "-Dfbn_DIR=${FBN_BUILD_DIR}")
  set(expect_dir "${FBN_BUILD_DIR}")
elseif(MODE STREQUAL "subdirectory")
  # An empty build type (plain -O0, the quickest full build of fbn's sources): fbn, not being the
  # top-level project, must leave the client's CMAKE_BUILD_TYPE alone (checked below).
  list(FILTER args EXCLUDE REGEX "^-DCMAKE_BUILD_TYPE=")
  list(APPEND args -DCMAKE_BUILD_TYPE= -DFBN_CONSUMER_MODE=subdirectory
       "-DFBN_SOURCE_DIR=${FBN_SOURCE_DIR}" "-DFBN_SANITIZE=${SANITIZE}")
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()

run("${CMAKE_COMMAND}" ${args})
if(DEFINED expect_dir)
  # The package must come from where this mode put it, not from anywhere else on the system.
  file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" fbn_dir_line REGEX "^fbn_DIR:")
  string(REGEX REPLACE "^fbn_DIR:[A-Z]+=" "" fbn_dir "${fbn_dir_line}")
  file(REAL_PATH "${fbn_dir}" fbn_dir)
  file(REAL_PATH "${expect_dir}" expect_dir)
  string(FIND "${fbn_dir}" "${expect_dir}" at)
  if(NOT at EQUAL 0)
    message(FATAL_ERROR "fbn was found in '${fbn_dir}', expected under '${expect_dir}'")
  endif()
endif()
run("${CMAKE_COMMAND}" --build "${WORK_DIR}/build" --parallel 2)
run("${WORK_DIR}/build/app")
if(MODE STREQUAL "subdirectory")
  file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" build_type_line REGEX "^CMAKE_BUILD_TYPE:")
  if(NOT build_type_line MATCHES "=$")
    message(FATAL_ERROR "add_subdirectory(fbn) changed the client's build type: "
                        "'${build_type_line}' (fbn must only default it when it is the top-level "
                        "project)")
  endif()
endif()
