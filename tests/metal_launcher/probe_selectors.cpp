// metal-cpp's selector and class tables for tests/metal_launcher/probe.cpp, as a Mac's libmlx defines
// them (MTL_PRIVATE_IMPLEMENTATION, NS_PRIVATE_IMPLEMENTATION): only the tables, through probe.cpp's
// sel_registerName and objc_lookUpClass, so any message the launcher sends links and is recorded.
#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <Foundation/NSPrivate.hpp>
#include <Metal/MTLHeaderBridge.hpp>
