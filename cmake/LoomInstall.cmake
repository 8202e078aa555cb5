# `cmake --install build --prefix P`: the driver, its libraries, the public headers a strategy plugin
# includes, and a CMake package, so that an out-of-tree plugin needs only
#   find_package(loom REQUIRED)  +  target_link_libraries(my_plugin PRIVATE loom::plugin)
# (plugins/example/ is the template). The plugins themselves install from plugins/CMakeLists.txt.
include(CMakePackageConfigHelpers)

# loom::plugin: what a strategy plugin links (the core and io libraries with their include paths).
add_library(loom_plugin INTERFACE)
target_link_libraries(loom_plugin INTERFACE loom_core loom_io)
add_library(loom::plugin ALIAS loom_plugin)
set_target_properties(loom_core PROPERTIES EXPORT_NAME core INSTALL_RPATH "$ORIGIN")
set_target_properties(loom_io PROPERTIES EXPORT_NAME io INSTALL_RPATH "$ORIGIN")
set_target_properties(loom_plugin PROPERTIES EXPORT_NAME plugin)
set_target_properties(loom PROPERTIES INSTALL_RPATH "$ORIGIN/../lib")

install(TARGETS loom RUNTIME DESTINATION bin)
install(TARGETS loom_core loom_io loom_plugin EXPORT loomTargets
        LIBRARY DESTINATION lib ARCHIVE DESTINATION lib INCLUDES DESTINATION include/loom)
# Headers keep their folders (#include "core/engine/plugin.hpp"), under P/include/loom.
foreach(dir core io)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}/ DESTINATION include/loom/${dir}
          FILES_MATCHING PATTERN "*.hpp" PATTERN "*.inc" PATTERN "test" EXCLUDE PATTERN "test_mpi" EXCLUDE)
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/generated/loom/build_info.hpp DESTINATION include/loom/loom)

install(EXPORT loomTargets NAMESPACE loom:: DESTINATION lib/cmake/loom)
set(LOOM_PLUGIN_DIR lib/loom)
set(LOOM_EXECUTABLE bin/loom)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/loomConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/generated/loomConfig.cmake INSTALL_DESTINATION lib/cmake/loom
                              PATH_VARS LOOM_PLUGIN_DIR LOOM_EXECUTABLE)
# The plugin ABI is checked when a plugin loads; the package version only has to match in its major.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/generated/loomConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${PROJECT_BINARY_DIR}/generated/loomConfig.cmake ${PROJECT_BINARY_DIR}/generated/loomConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/LoomKokkos.cmake
        DESTINATION lib/cmake/loom)

# What a user runs and copies: the decks, the job scripts (sweeps and plots among them), the template.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/inputs/ DESTINATION share/loom/inputs)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/jobscripts/ DESTINATION share/loom/jobscripts USE_SOURCE_PERMISSIONS)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/plugins/example/ DESTINATION share/loom/examples/plugin)
