# Warning and sanitizer flags for fbn's own targets only (never CMAKE_CXX_FLAGS). Applied as
# PRIVATE options, so nothing leaks into the exported targets.
set(FBN_WARNING_FLAGS -Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wcast-align -Wunused
    -Woverloaded-virtual -Wnull-dereference -Wformat=2)
if(FBN_WERROR)
  list(APPEND FBN_WARNING_FLAGS -Werror)
endif()
if(FBN_SANITIZE)
  string(REPLACE ";" "," _fbn_san "${FBN_SANITIZE}")
  set(FBN_SANITIZE_FLAGS -fsanitize=${_fbn_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
endif()

function(fbn_apply_flags target)
  target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU,Clang>:${FBN_WARNING_FLAGS}>
                                           ${FBN_SANITIZE_FLAGS})
  if(FBN_SANITIZE)
    target_link_options(${target} PRIVATE -fsanitize=${_fbn_san})
  endif()
endfunction()
