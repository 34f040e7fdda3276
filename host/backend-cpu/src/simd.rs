//! Compile a function body twice — once for AVX-512 (+FMA), once portable — and pick at run time.
//! Only the *loops* change (wider vectors, fused multiply-adds); the arithmetic is the same.

#[cfg(target_arch = "x86_64")]
pub fn has_avx512() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("fma")
    })
}

/// `simd_fn! { pub fn name(args) -> ret { body } }` — body compiled with and without AVX-512.
macro_rules! simd_fn {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn imp($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? { imp($($arg),*) }
                if $crate::simd::has_avx512() {
                    // SAFETY: the features were detected at run time.
                    return unsafe { fast($($arg),*) };
                }
            }
            imp($($arg),*)
        }
    };
}
pub(crate) use simd_fn;

/// `y += a·x`.
#[inline(always)]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv = xv.mul_add(a, *yv);
    }
}

/// While alive, the current thread flushes denormal results and inputs to zero (MXCSR FTZ|DAZ),
/// restoring the previous mode on drop. Decaying recurrent states (KDA: up to e^−5 per token)
/// drift into the denormal range, where every multiply takes a ~100-cycle microcode assist;
/// values below 1.2e-38 carry no information next to the state's O(1) entries.
pub struct FlushDenormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

impl FlushDenormals {
    pub fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let mut saved: u32 = 0;
            // SAFETY: stmxcsr/ldmxcsr only read/write the SSE control register of this thread;
            // bits 15 (FTZ) and 6 (DAZ) change denormal handling, nothing else.
            unsafe {
                std::arch::asm!("stmxcsr [{}]", in(reg) &mut saved, options(nostack));
                let flushed = saved | (1 << 15) | (1 << 6);
                std::arch::asm!("ldmxcsr [{}]", in(reg) &flushed, options(nostack, readonly));
            }
            Self { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Self {}
    }
}

impl Default for FlushDenormals {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FlushDenormals {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: restores the value read in `new`.
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &self.saved, options(nostack, readonly));
        }
    }
}
