# Provides the target loom::kokkos (loom's build, and loom's installed CMake package for plugins).
if(TARGET loom::kokkos)
  return()
endif()
# Prefer a working find_package(Kokkos) (a cluster's own Kokkos); Debian's libtrilinos-kokkos-dev
# ships a KokkosConfig.cmake whose include directory is wrong (/usr/lib/include), so when the
# package's target does not actually lead to Kokkos_Core.hpp we fall back to the headers in
# /usr/include/trilinos and the library libtrilinos_kokkoscore.
find_package(Kokkos QUIET)
set(_loom_kokkos_ok FALSE)
if(TARGET Kokkos::kokkos)
  get_target_property(_kk_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
  foreach(_d IN LISTS _kk_inc)
    if(EXISTS "${_d}/Kokkos_Core.hpp")
      set(_loom_kokkos_ok TRUE)
    endif()
  endforeach()
endif()
if(_loom_kokkos_ok)
  add_library(loom::kokkos INTERFACE IMPORTED)
  target_link_libraries(loom::kokkos INTERFACE Kokkos::kokkos)
  set(LOOM_KOKKOS_ORIGIN "find_package(Kokkos) ${Kokkos_VERSION}")
else()
  find_path(LOOM_KOKKOS_INCLUDE_DIR Kokkos_Core.hpp PATHS /usr/include/trilinos PATH_SUFFIXES trilinos)
  find_library(LOOM_KOKKOS_CORE_LIBRARY NAMES kokkoscore trilinos_kokkoscore)
  if(NOT LOOM_KOKKOS_INCLUDE_DIR OR NOT LOOM_KOKKOS_CORE_LIBRARY)
    message(FATAL_ERROR "Kokkos not found: install libtrilinos-kokkos-dev (bash setup.sh) or set Kokkos_DIR")
  endif()
  add_library(loom::kokkos INTERFACE IMPORTED)
  set_target_properties(loom::kokkos PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${LOOM_KOKKOS_INCLUDE_DIR}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${LOOM_KOKKOS_INCLUDE_DIR}"
    INTERFACE_LINK_LIBRARIES "${LOOM_KOKKOS_CORE_LIBRARY};dl")
  set(LOOM_KOKKOS_ORIGIN "fallback ${LOOM_KOKKOS_CORE_LIBRARY}")
endif()
message(STATUS "loom: Kokkos from ${LOOM_KOKKOS_ORIGIN}")
