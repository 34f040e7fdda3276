//! What can be wrong with one image (the client's problem: HTTP 400) or with the options (the
//! server's configuration).

/// Why one image was refused. The message names the problem for the client.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ImageProblem {
    #[error("empty data (0 bytes) is not an image")]
    Empty,
    #[error("not an image: the data is not PNG, JPEG, WebP or GIF{}", declared_note(.declared))]
    NotAnImage { declared: Option<String> },
    #[error("unsupported image format {0} (supported: PNG, JPEG, WebP, GIF)")]
    UnsupportedFormat(String),
    #[error("declared MIME type {0:?} is not an image type")]
    NotImageMime(String),
    #[error("declared {declared} but the data is {actual}")]
    MimeMismatch {
        declared: String,
        actual: &'static str,
    },
    #[error("truncated or corrupt {format} data: {detail}")]
    Truncated {
        format: &'static str,
        detail: String,
    },
    #[error("unsupported {format} feature: {detail}")]
    UnsupportedFeature {
        format: &'static str,
        detail: String,
    },
    #[error("zero-sized image ({width}x{height})")]
    ZeroSized { width: u32, height: u32 },
    #[error("image is {width}x{height}: a side exceeds the limit of {limit} pixels")]
    SideTooLarge { width: u32, height: u32, limit: u32 },
    #[error("image is {width}x{height} ({pixels} pixels), more than the limit of {limit} pixels")]
    TooManyPixels {
        width: u32,
        height: u32,
        pixels: u64,
        limit: u64,
    },
    #[error("image is {width}x{height}: aspect ratio {ratio:.1}:1 exceeds the limit of {limit}:1")]
    AspectRatio {
        width: u32,
        height: u32,
        ratio: f64,
        limit: f64,
    },
    #[error("image is too large to decode within the limits: {0}")]
    DecodeLimit(String),
    #[error("detail must be \"low\", \"high\" or \"auto\", got {0:?}")]
    BadDetail(String),
}

fn declared_note(declared: &Option<String>) -> String {
    declared
        .as_ref()
        .map(|m| format!(" (declared {m})"))
        .unwrap_or_default()
}

/// A failure of the stage: a bad image (invalid input) or bad options (the server's settings).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MediaError {
    #[error("image {index}: {problem}")]
    Image { index: u32, problem: ImageProblem },
    #[error("media options: {0}")]
    Options(String),
}

impl MediaError {
    /// Whether the client's image (not the server's options) is at fault.
    pub fn is_invalid_input(&self) -> bool {
        matches!(self, MediaError::Image { .. })
    }
}
