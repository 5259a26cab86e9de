# fbn::mpi (-DFBN_WITH_MPI=ON): fbn's Communicator over an MPI_Comm, the synchronized ops on an
# MPI_Comm, and MPI_COMM_WORLD as the default communicator of synchronized layers (fbn/mpi.h).
# The synchronization itself lives in fbn (fbn/distributed.h), which never needs MPI.
set(MPI_CXX_SKIP_MPICXX ON)  # the C API only: no deprecated C++ bindings
find_package(MPI REQUIRED COMPONENTS CXX)
include(GenerateExportHeader)

add_library(fbn_mpi ${PROJECT_SOURCE_DIR}/src/distributed/mpi_communicator.cc)
add_library(fbn::mpi ALIAS fbn_mpi)
generate_export_header(fbn_mpi BASE_NAME FBN_MPI EXPORT_MACRO_NAME FBN_MPI_API
                       EXPORT_FILE_NAME ${PROJECT_BINARY_DIR}/include/fbn/mpi_export.h)
set_target_properties(fbn_mpi PROPERTIES
  EXPORT_NAME mpi
  CXX_VISIBILITY_PRESET hidden
  VISIBILITY_INLINES_HIDDEN ON
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
if(NOT BUILD_SHARED_LIBS)
  target_compile_definitions(fbn_mpi PUBLIC FBN_MPI_STATIC_DEFINE)
endif()
target_link_libraries(fbn_mpi PUBLIC fbn MPI::MPI_CXX)
target_compile_features(fbn_mpi PUBLIC cxx_std_17)
fbn_apply_flags(fbn_mpi)

if(FBN_BUILD_TESTS)
  enable_testing()
  add_subdirectory(${PROJECT_SOURCE_DIR}/tests/mpi ${PROJECT_BINARY_DIR}/tests/mpi)
endif()

if(FBN_INSTALL)
  install(TARGETS fbn_mpi EXPORT fbnMpiTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(FILES ${PROJECT_BINARY_DIR}/include/fbn/mpi_export.h
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/fbn)
  install(EXPORT fbnMpiTargets NAMESPACE fbn:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/fbn)
  export(EXPORT fbnMpiTargets NAMESPACE fbn:: FILE ${PROJECT_BINARY_DIR}/fbnMpiTargets.cmake)
endif()
