// Declarations only: the part of Apple's SDK that mps_src/mps/*.mm and the torch headers they
// include use, each declared as Apple's headers declare it (macOS 14 SDK), so that clang on Linux
// can type-check the Objective-C++ host (tests/mps/test_objc_check.py). Nothing here links or
// runs. Add a declaration only when a file starts using it, copying Apple's signature and its
// availability.
//
// Availability: every Metal declaration carries Apple's API_AVAILABLE or API_DEPRECATED
// annotation, with the versions and spelling of the SDK. Here the annotations expand to
// nothing; the syntax check (tests/mps/test_objc_check.py) rewrites them, for the build's
// deployment target (mps_src/mps/build_macos.py, DEPLOYMENT_TARGET), into `unavailable` for an
// API introduced later and `deprecated` for one deprecated by then, so that using either fails
// the check as -Wunguarded-availability-new / -Wdeprecated-declarations would on the Mac.
// Foundation, dispatch, CoreFoundation and IOKit declarations below predate every macOS that
// Metal 3.1 runs on and are left unannotated, but for kIOMainPortDefault (macOS 12).
#pragma once

#ifndef __OBJC__
#error "apple_sdk_subset.h is for the Objective-C++ syntax check"
#endif

#include <stddef.h>
#include <stdint.h>

#ifndef API_AVAILABLE
#define API_AVAILABLE(...)
#endif
#ifndef API_DEPRECATED
#define API_DEPRECATED(...)
#endif

#pragma clang assume_nonnull begin

// ---- Foundation ------------------------------------------------------------------------------

typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef bool BOOL;  // arm64 macOS: OBJC_BOOL_IS_BOOL
#define YES __objc_yes  // <objc/objc.h> with objc_bool
#define NO __objc_no
#define nil nullptr  // <objc/objc.h> under C++11

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(nullable, readonly) const char* UTF8String;
@end

@interface NSArray<__covariant ObjectType> : NSObject
- (BOOL)containsObject:(ObjectType)anObject;
@end

@interface NSDictionary<__covariant KeyType, __covariant ObjectType> : NSObject
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

// ---- dispatch (libdispatch with OS_OBJECT_USE_OBJC, as in Objective-C on macOS) ---------------

@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
void dispatch_sync(dispatch_queue_t queue, __attribute__((noescape)) dispatch_block_t block);

// ---- CoreFoundation (CFBase.h, CFNumber.h, CFString.h: what library.mm reads a number with) -----

typedef unsigned char Boolean;
typedef long CFIndex;
typedef unsigned long CFTypeID;
typedef const void* CFTypeRef;
typedef const struct __CFAllocator* CFAllocatorRef;
typedef const struct __CFString* CFStringRef;
typedef const struct __CFNumber* CFNumberRef;
typedef const struct __CFDictionary* CFDictionaryRef;
typedef struct __CFDictionary* CFMutableDictionaryRef;
#define CF_RETURNS_RETAINED __attribute__((cf_returns_retained))
#define CF_RELEASES_ARGUMENT __attribute__((cf_consumed))
// CFString.h's constant string literal, as clang builds it.
#define CFSTR(cStr) ((CFStringRef)__builtin___CFStringMakeConstantString("" cStr ""))
extern const CFAllocatorRef _Nullable kCFAllocatorDefault;
// typedef CF_ENUM(CFIndex, CFNumberType) { ... }, as CF_ENUM expands it.
typedef enum CFNumberType : CFIndex CFNumberType;
enum CFNumberType : CFIndex {
  kCFNumberSInt64Type = 4,
};
CFTypeID CFGetTypeID(CFTypeRef cf);
CFTypeID CFNumberGetTypeID(void);
Boolean CFNumberGetValue(CFNumberRef number, CFNumberType theType, void* valuePtr);
void CFRelease(CFTypeRef cf);

// ---- IOKit (IOKitLib.h, mach/kern_return.h: the registry look-up of library.mm) -----------------

typedef unsigned int mach_port_t;
typedef int kern_return_t;
typedef unsigned int IOOptionBits;
typedef mach_port_t io_object_t;
typedef io_object_t io_iterator_t;
typedef io_object_t io_registry_entry_t;
#define KERN_SUCCESS 0
#define IO_OBJECT_NULL ((io_object_t)0)
extern const mach_port_t kIOMainPortDefault API_AVAILABLE(macos(12.0), ios(15.0));
CFMutableDictionaryRef _Nullable IOServiceMatching(const char* name) CF_RETURNS_RETAINED;
kern_return_t IOServiceGetMatchingServices(
    mach_port_t mainPort, CFDictionaryRef _Nullable matching CF_RELEASES_ARGUMENT,
    io_iterator_t* existing);
io_object_t IOIteratorNext(io_iterator_t iterator);
kern_return_t IOObjectRelease(io_object_t object);
CFTypeRef _Nullable IORegistryEntryCreateCFProperty(io_registry_entry_t entry, CFStringRef key,
                                                    CFAllocatorRef _Nullable allocator,
                                                    IOOptionBits options) CF_RETURNS_RETAINED;

// ---- Metal -----------------------------------------------------------------------------------

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

typedef enum : NSUInteger {
  MTLDataTypeFloat = 3,
  MTLDataTypeInt = 29,
  MTLDataTypeUInt = 33,
  MTLDataTypeBool = 53,
} MTLDataType;

typedef enum : NSUInteger {
  MTLLanguageVersion3_1 API_AVAILABLE(macos(14.0), ios(17.0)) = (3 << 16) + 1,
} API_AVAILABLE(macos(10.11), ios(9.0)) MTLLanguageVersion;

// typedef NS_ENUM(NSInteger, MTLMathMode) { ... } API_AVAILABLE(...), as NS_ENUM expands it.
typedef enum MTLMathMode : NSInteger MTLMathMode;
enum MTLMathMode : NSInteger {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
} API_AVAILABLE(macos(15.0), ios(18.0));

// typedef NS_ENUM(NSInteger, MTLGPUFamily) { ... }: the host passes families by value
// (library.mm: the Metal 4 and Apple10 enumerators are macOS 26 SDK names).
typedef enum MTLGPUFamily : NSInteger MTLGPUFamily;
enum MTLGPUFamily : NSInteger {
  MTLGPUFamilyApple1 = 1001,
} API_AVAILABLE(macos(10.15), ios(13.0));

@protocol MTLDevice;
@protocol MTLCommandBuffer;

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLResource <NSObject>
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLBuffer <MTLResource>
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLFunction <NSObject>
@end

API_AVAILABLE(macos(10.12), ios(10.0))
@interface MTLFunctionConstantValues : NSObject
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@property(readwrite, nonatomic) BOOL fastMathEnabled
    API_DEPRECATED("Use mathMode instead", macos(10.11, 15.0), ios(8.0, 18.0));
@property(readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0), ios(18.0));
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLLibrary <NSObject>
@property(readonly) NSArray<NSString*>* functionNames;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)name
                                 constantValues:(MTLFunctionConstantValues*)constantValues
                                          error:(__autoreleasing NSError**)error
    API_AVAILABLE(macos(10.12), ios(10.0));
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger staticThreadgroupMemoryLength
    API_AVAILABLE(macos(10.13), ios(11.0));
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLCommandEncoder <NSObject>
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer
           offset:(NSUInteger)offset
          atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid
       threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLCommandBuffer <NSObject>
@end
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLCommandQueue <NSObject>
@end

API_AVAILABLE(macos(10.14), ios(12.0))
@protocol MTLEvent <NSObject>
@end
API_AVAILABLE(macos(10.14), ios(12.0))
@protocol MTLSharedEvent <MTLEvent>
@end

API_AVAILABLE(macos(10.11), ios(8.0))
@protocol MTLDevice <NSObject>
@property(nonnull, readonly) NSString* name;
@property(readonly) NSUInteger maxThreadgroupMemoryLength
    API_AVAILABLE(macos(10.13), ios(11.0));
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily API_AVAILABLE(macos(10.15), ios(13.0));
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url
                                       error:(__autoreleasing NSError**)error
    API_AVAILABLE(macos(10.13), ios(11.0));
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError**)error;
- (nullable id<MTLComputePipelineState>)
    newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                  error:(__autoreleasing NSError**)error;
@end

// ---- MetalPerformanceShaders(Graph): only the class names that torch's MPSStream.h uses -------

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end

@interface MPSGraphObject : NSObject
@end
@interface MPSGraph : MPSGraphObject
@end
@interface MPSGraphExecutionDescriptor : MPSGraphObject
@end
@interface MPSGraphCompilationDescriptor : MPSGraphObject
@end

#pragma clang assume_nonnull end
