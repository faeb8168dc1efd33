//! Run-time bindings of the HIP runtime (`libamdhip64`) and hiprtc (`libhiprtc`): our own
//! `#[repr(C)]`-level declarations of the entry points strata uses, resolved with libloading
//! when first needed. Not `hip-sys`: its build script links libamdhip64 at build time (it
//! needs a ROCm install to build), and the executor must build and run on machines without
//! ROCm, as it does without CUDA. The values below are ROCm 6/7's ABI (the versioned
//! `hipGetDevicePropertiesR0600` and the `hipDeviceAttribute_t` numbering of HIP 6+).
//! Invariant: every symbol is resolved when its library is opened, so a missing one is an
//! error naming it at start-up, never a crash mid-run; the libraries stay loaded for the
//! life of the process (the tables live in a `OnceLock`), so the function pointers never
//! dangle.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

/// `hipError_t` (0 = success).
pub type HipResult = c_int;
/// `hiprtcResult` (0 = success).
pub type RtcResult = c_int;
/// `hipStream_t`; null is the device's default stream.
pub type Stream = *mut c_void;
/// `hipEvent_t`.
pub type Event = *mut c_void;
/// `hipModule_t`.
pub type Module = *mut c_void;
/// `hipFunction_t`.
pub type Function = *mut c_void;
/// `hipGraph_t`.
pub type Graph = *mut c_void;
/// `hipGraphExec_t`.
pub type GraphExec = *mut c_void;
/// `hiprtcProgram`.
pub type Program = *mut c_void;

/// `hipDeviceAttribute_t` values (HIP 6 and 7).
pub mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 56;
    pub const MULTIPROCESSOR_COUNT: i32 = 63;
    pub const MAX_SHARED_MEMORY_PER_BLOCK: i32 = 74;
    pub const WARP_SIZE: i32 = 87;
    pub const WALL_CLOCK_RATE_KHZ: i32 = 10017;
}

/// `hipMemcpyKind`.
pub mod memcpy_kind {
    pub const HOST_TO_DEVICE: i32 = 1;
    pub const DEVICE_TO_HOST: i32 = 2;
    pub const DEVICE_TO_DEVICE: i32 = 3;
    /// The runtime infers the direction from the addresses (unified addressing): also
    /// between two devices.
    pub const DEFAULT: i32 = 4;
}

/// `hipStreamNonBlocking`: the stream does not synchronize with the null stream.
pub const STREAM_NON_BLOCKING: u32 = 1;
/// `hipEventDefault` (timing enabled).
pub const EVENT_DEFAULT: u32 = 0;
/// `hipHostMallocDefault`.
pub const HOST_MALLOC_DEFAULT: u32 = 0;
/// `hipHostMallocPortable`: pinned for every device, not only the current one.
pub const HOST_MALLOC_PORTABLE: u32 = 1;
/// `hipHostMallocMapped`: also mapped into the devices' address space
/// (`hipHostGetDevicePointer`).
pub const HOST_MALLOC_MAPPED: u32 = 2;
/// `hipErrorPeerAccessAlreadyEnabled`.
pub const ERROR_PEER_ACCESS_ALREADY_ENABLED: HipResult = 704;
/// `hipStreamCaptureModeThreadLocal`: other threads' unsafe calls do not break a capture.
pub const CAPTURE_MODE_THREAD_LOCAL: i32 = 1;
/// `hipErrorNoDevice`.
pub const ERROR_NO_DEVICE: HipResult = 100;
/// Size of `hipDeviceProp_tR0600` in ROCm 7.2 (1472 bytes); we hand the runtime a larger
/// zeroed buffer and read two fields at their fixed offsets.
pub const DEVICE_PROP_BUFFER: usize = 4096;
/// Offset of `char gcnArchName[256]` in `hipDeviceProp_tR0600`.
pub const PROP_GCN_ARCH_NAME: usize = 1160;
/// Offset of `size_t totalGlobalMem` in `hipDeviceProp_tR0600`.
pub const PROP_TOTAL_GLOBAL_MEM: usize = 288;

/// A library that could not be opened, with every file name tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadFailure {
    /// What the library is, for the message ("libamdhip64 (the HIP runtime)").
    pub lib: &'static str,
    /// Every name or path handed to the dynamic loader, in order.
    pub candidates: Vec<String>,
    /// The loader's reasons for files that exist but did not load (a too-old glibc, a
    /// missing dependency, a missing symbol); empty when no candidate was found at all.
    pub reasons: Vec<String>,
}

impl std::fmt::Display for LoadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "could not load {} (tried {:?})",
            self.lib, self.candidates
        )?;
        for r in &self.reasons {
            write!(f, "; {r}")?;
        }
        write!(
            f,
            "; install ROCm 6 or 7 (libamdhip64 and libhiprtc with libamd_comgr: Debian's \
             libamdhip64-7 and libhiprtc7, or AMD's rocm packages in /opt/rocm/lib) or add \
             their folder to LD_LIBRARY_PATH"
        )
    }
}

/// The names the dynamic loader is asked for, unversioned first, then ROCm 7 and 6, then
/// the same under `/opt/rocm/lib` (AMD's packages do not add it to the loader's path).
pub fn candidates(stem: &str) -> Vec<String> {
    let names = [
        format!("{stem}.so"),
        format!("{stem}.so.7"),
        format!("{stem}.so.6"),
    ];
    let mut out: Vec<String> = names.to_vec();
    out.extend(names.iter().map(|n| format!("/opt/rocm/lib/{n}")));
    out
}

/// Whether a dlopen error only says the file is not there (as opposed to a real reason).
fn is_not_found(msg: &str) -> bool {
    msg.contains("No such file") || msg.contains("cannot open shared object file")
}

/// Opens the first candidate that loads and resolves `check` (a symbol every good version
/// exports), or says why none did.
fn open_first(
    lib: &'static str,
    names: &[String],
    check: &[u8],
) -> Result<(libloading::Library, String), LoadFailure> {
    let mut reasons = Vec::new();
    for name in names {
        // SAFETY: loading a library runs its initialisers; libamdhip64 and libhiprtc are
        // ordinary shared libraries whose initialisers only set up their own state.
        match unsafe { libloading::Library::new(name) } {
            Ok(l) => {
                // SAFETY: only looks the symbol up; it is not called here.
                if unsafe { l.get::<*const c_void>(check) }.is_ok() {
                    return Ok((l, name.clone()));
                }
                let sym = String::from_utf8_lossy(&check[..check.len() - 1]).into_owned();
                reasons.push(format!("{name} lacks {sym} (too old a ROCm)"));
            }
            Err(e) => {
                // libloading's own text is "dlopen failed"; the loader's reason is its source.
                let msg = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                if !is_not_found(&msg) {
                    reasons.push(msg);
                }
            }
        }
    }
    Err(LoadFailure {
        lib,
        candidates: names.to_vec(),
        reasons,
    })
}

/// Declares a table of entry points and its loader: `field = "symbol": fn(args) -> ret;`.
macro_rules! api_table {
    ($(#[$doc:meta])* $name:ident { $($field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty;)* }) => {
        $(#[$doc])*
        pub struct $name {
            /// The file the dynamic loader opened.
            pub path: String,
            $(pub $field: unsafe extern "C" fn($($arg),*) -> $ret,)*
            _lib: libloading::Library,
        }

        impl $name {
            fn resolve(lib: libloading::Library, path: String, what: &'static str)
                -> Result<Self, LoadFailure> {
                let missing = |sym: &str| LoadFailure {
                    lib: what,
                    candidates: vec![path.clone()],
                    reasons: vec![format!("{path} has no symbol {sym} (too old a ROCm)")],
                };
                $(
                    // SAFETY: the symbol's C signature is the one declared in this table
                    // (HIP 6/7 headers); the pointer is copied out and stays valid because
                    // the library is kept in the same struct and never unloaded.
                    let $field = unsafe {
                        *lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                            concat!($sym, "\0").as_bytes(),
                        )
                        .map_err(|_| missing($sym))?
                    };
                )*
                Ok(Self { path, $($field,)* _lib: lib })
            }
        }
    };
}

api_table! {
    /// The HIP runtime's entry points strata calls.
    HipApi {
        init = "hipInit": fn(c_uint) -> HipResult;
        runtime_get_version = "hipRuntimeGetVersion": fn(*mut c_int) -> HipResult;
        driver_get_version = "hipDriverGetVersion": fn(*mut c_int) -> HipResult;
        get_device_count = "hipGetDeviceCount": fn(*mut c_int) -> HipResult;
        set_device = "hipSetDevice": fn(c_int) -> HipResult;
        device_get_name = "hipDeviceGetName": fn(*mut c_char, c_int, c_int) -> HipResult;
        device_get_attribute = "hipDeviceGetAttribute": fn(*mut c_int, c_int, c_int) -> HipResult;
        get_device_properties = "hipGetDevicePropertiesR0600": fn(*mut c_void, c_int) -> HipResult;
        device_get_pci_bus_id = "hipDeviceGetPCIBusId": fn(*mut c_char, c_int, c_int) -> HipResult;
        device_total_mem = "hipDeviceTotalMem": fn(*mut usize, c_int) -> HipResult;
        mem_get_info = "hipMemGetInfo": fn(*mut usize, *mut usize) -> HipResult;
        device_can_access_peer = "hipDeviceCanAccessPeer": fn(*mut c_int, c_int, c_int) -> HipResult;
        device_enable_peer_access = "hipDeviceEnablePeerAccess": fn(c_int, c_uint) -> HipResult;
        device_synchronize = "hipDeviceSynchronize": fn() -> HipResult;
        malloc = "hipMalloc": fn(*mut *mut c_void, usize) -> HipResult;
        free = "hipFree": fn(*mut c_void) -> HipResult;
        host_malloc = "hipHostMalloc": fn(*mut *mut c_void, usize, c_uint) -> HipResult;
        host_free = "hipHostFree": fn(*mut c_void) -> HipResult;
        host_get_device_pointer = "hipHostGetDevicePointer": fn(*mut *mut c_void, *mut c_void, c_uint) -> HipResult;
        memcpy_async = "hipMemcpyAsync": fn(*mut c_void, *const c_void, usize, c_int, Stream) -> HipResult;
        memset_async = "hipMemsetAsync": fn(*mut c_void, c_int, usize, Stream) -> HipResult;
        stream_create = "hipStreamCreateWithFlags": fn(*mut Stream, c_uint) -> HipResult;
        stream_destroy = "hipStreamDestroy": fn(Stream) -> HipResult;
        stream_synchronize = "hipStreamSynchronize": fn(Stream) -> HipResult;
        stream_wait_event = "hipStreamWaitEvent": fn(Stream, Event, c_uint) -> HipResult;
        event_create = "hipEventCreateWithFlags": fn(*mut Event, c_uint) -> HipResult;
        event_record = "hipEventRecord": fn(Event, Stream) -> HipResult;
        event_synchronize = "hipEventSynchronize": fn(Event) -> HipResult;
        event_elapsed_time = "hipEventElapsedTime": fn(*mut f32, Event, Event) -> HipResult;
        event_destroy = "hipEventDestroy": fn(Event) -> HipResult;
        module_load_data = "hipModuleLoadData": fn(*mut Module, *const c_void) -> HipResult;
        module_unload = "hipModuleUnload": fn(Module) -> HipResult;
        module_get_function = "hipModuleGetFunction": fn(*mut Function, Module, *const c_char) -> HipResult;
        module_launch_kernel = "hipModuleLaunchKernel": fn(
            Function, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Stream,
            *mut *mut c_void, *mut *mut c_void
        ) -> HipResult;
        stream_begin_capture = "hipStreamBeginCapture": fn(Stream, c_int) -> HipResult;
        stream_end_capture = "hipStreamEndCapture": fn(Stream, *mut Graph) -> HipResult;
        graph_instantiate = "hipGraphInstantiate": fn(*mut GraphExec, Graph, *mut c_void, *mut c_char, usize) -> HipResult;
        graph_launch = "hipGraphLaunch": fn(GraphExec, Stream) -> HipResult;
        graph_exec_destroy = "hipGraphExecDestroy": fn(GraphExec) -> HipResult;
        graph_destroy = "hipGraphDestroy": fn(Graph) -> HipResult;
        get_error_name = "hipGetErrorName": fn(HipResult) -> *const c_char;
        get_error_string = "hipGetErrorString": fn(HipResult) -> *const c_char;
    }
}

api_table! {
    /// hiprtc's entry points (the runtime compiler; it opens libamd_comgr itself).
    RtcApi {
        version = "hiprtcVersion": fn(*mut c_int, *mut c_int) -> RtcResult;
        create_program = "hiprtcCreateProgram": fn(
            *mut Program, *const c_char, *const c_char, c_int, *const *const c_char,
            *const *const c_char
        ) -> RtcResult;
        compile_program = "hiprtcCompileProgram": fn(Program, c_int, *const *const c_char) -> RtcResult;
        get_program_log_size = "hiprtcGetProgramLogSize": fn(Program, *mut usize) -> RtcResult;
        get_program_log = "hiprtcGetProgramLog": fn(Program, *mut c_char) -> RtcResult;
        get_code_size = "hiprtcGetCodeSize": fn(Program, *mut usize) -> RtcResult;
        get_code = "hiprtcGetCode": fn(Program, *mut c_char) -> RtcResult;
        destroy_program = "hiprtcDestroyProgram": fn(*mut Program) -> RtcResult;
        get_error_string = "hiprtcGetErrorString": fn(RtcResult) -> *const c_char;
    }
}

/// The HIP runtime, opened on first use (and the same failure reported every time after).
pub fn hip() -> Result<&'static HipApi, LoadFailure> {
    static HIP: OnceLock<Result<HipApi, LoadFailure>> = OnceLock::new();
    const WHAT: &str = "libamdhip64 (the HIP runtime)";
    HIP.get_or_init(|| {
        let (lib, path) = open_first(WHAT, &candidates("libamdhip64"), b"hipInit\0")?;
        HipApi::resolve(lib, path, WHAT)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// hiprtc, opened on first use.
pub fn rtc() -> Result<&'static RtcApi, LoadFailure> {
    static RTC: OnceLock<Result<RtcApi, LoadFailure>> = OnceLock::new();
    const WHAT: &str = "libhiprtc (the HIP runtime compiler)";
    RTC.get_or_init(|| {
        let (lib, path) = open_first(WHAT, &candidates("libhiprtc"), b"hiprtcCompileProgram\0")?;
        RtcApi::resolve(lib, path, WHAT)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// A C string from the runtime as an owned Rust string ("" for null).
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call (HIP
/// and hiprtc return static strings from their error-text functions).
pub unsafe fn c_text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller guarantees a valid NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The text of a NUL-terminated (or full) byte buffer a HIP call wrote into.
pub fn buffer_text(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_cover_rocm_7_and_6_and_opt_rocm() {
        let c = candidates("libhiprtc");
        assert_eq!(c[0], "libhiprtc.so");
        assert!(c.contains(&"libhiprtc.so.7".to_string()));
        assert!(c.contains(&"libhiprtc.so.6".to_string()));
        assert!(c.contains(&"/opt/rocm/lib/libhiprtc.so.7".to_string()));
        assert_eq!(c.len(), 6);
    }

    #[test]
    fn a_missing_library_names_every_file_tried_and_the_fix() {
        let names = vec!["libstrata-no-such-lib.so.7".to_string()];
        let e = open_first("libnothing (a test)", &names, b"x\0").unwrap_err();
        assert!(e.reasons.is_empty(), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("libnothing (a test)"), "{msg}");
        assert!(msg.contains("libstrata-no-such-lib.so.7"), "{msg}");
        assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
        assert!(msg.contains("libhiprtc7"), "{msg}");
    }

    #[test]
    fn a_library_that_loads_but_lacks_the_symbol_says_so() {
        // libc is always there and has no HIP symbol.
        let names = vec!["libc.so.6".to_string()];
        let e = open_first("libc (a test)", &names, b"hipInit\0").unwrap_err();
        assert_eq!(e.reasons.len(), 1, "{e:?}");
        assert!(e.reasons[0].contains("lacks hipInit"), "{e:?}");
    }

    #[test]
    fn a_file_that_is_not_a_library_gives_the_loaders_reason() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libamdhip64.so.7");
        std::fs::write(&p, b"not an ELF file").unwrap();
        let names = vec![p.display().to_string()];
        let e = open_first("libamdhip64 (a test)", &names, b"hipInit\0").unwrap_err();
        assert_eq!(e.reasons.len(), 1, "{e:?}");
        assert!(e.to_string().contains("libamdhip64.so.7"), "{e}");
    }

    #[test]
    fn buffer_text_stops_at_nul() {
        assert_eq!(buffer_text(b"gfx1201:xnack-\0junk"), "gfx1201:xnack-");
        assert_eq!(buffer_text(b"abc"), "abc");
        // SAFETY: null is allowed.
        assert_eq!(unsafe { c_text(std::ptr::null()) }, "");
    }
}
