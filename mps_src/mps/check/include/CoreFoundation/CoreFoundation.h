// Stand-in for <CoreFoundation/CoreFoundation.h> in the syntax check: see ../../apple_sdk_subset.h.
#pragma once
#include "../../apple_sdk_subset.h"
