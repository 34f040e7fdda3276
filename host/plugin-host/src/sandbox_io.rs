//! The sandbox's `wasi:io/poll` and `wasi:io/streams`, shadowing wasmtime-wasi's synchronous
//! ones.
//!
//! wasmtime-wasi's sync bindings run every potentially blocking call (`poll`, `blocking-read`,
//! `blocking-write-and-flush`, dropping a stream, …) through `wasmtime_wasi::runtime::in_tokio`,
//! which calls `Handle::block_on` whenever a tokio runtime is current on the thread. The server
//! calls parsers straight from async tasks, so a guest that merely printed its panic message
//! (stderr is `blocking-write-and-flush`) or slept panicked the host task with "Cannot start a
//! runtime from within a runtime". These versions never block and never enter a runtime: they
//! poll the operation's future a few times with a no-op waker. In the sandbox every legitimate
//! operation is ready at once (in-memory stdout/stderr, empty stdin, zero timeouts); one that
//! would wait (a timer: there is nothing else to wait for) fails the call with
//! [`SandboxDenied`], which the runtime reports as [`crate::PluginError::Denied`].
//!
//! Sockets, name lookup and files are refused before any of this: the `WasiCtx` allows no TCP,
//! UDP or lookups and preopens nothing, so the guest gets WASI error codes (`docs/plugins.md`,
//! "Fault model").

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};
use wasmtime_wasi::p2::bindings::sync::io::{poll, streams};
use wasmtime_wasi::p2::{DynInputStream, DynOutputStream, DynPollable, StreamError, StreamResult};
use wasmtime_wasi_io::bindings::wasi::io::poll as async_poll;
use wasmtime_wasi_io::bindings::wasi::io::streams as async_streams;
use wasmtime_wasi_io::bindings::wasi::io::streams::{
    HostInputStream as AsyncInputStream, HostOutputStream as AsyncOutputStream,
};

use crate::runtime::StoreState;

/// Polls before an operation counts as blocking. More than one: an already-elapsed timer
/// yields once to tokio before it reports ready (see wasmtime-wasi's `Deadline::Past`).
const POLLS_BEFORE_BLOCKING: usize = 4;

/// A guest operation that would have to wait, which the sandbox does not allow.
#[derive(Debug, thiserror::Error)]
#[error(
    "`{operation}` would block, and plugins may not wait (they have no clock, network or files to wait for)"
)]
pub(crate) struct SandboxDenied {
    pub operation: &'static str,
}

/// The resource table, seen through the sandbox's non-blocking io.
pub(crate) struct SandboxIo<'a>(&'a mut ResourceTable);

struct HasSandboxIo;
impl HasData for HasSandboxIo {
    type Data<'a> = SandboxIo<'a>;
}

/// Replace wasmtime-wasi's sync `wasi:io/poll` and `wasi:io/streams` in `linker` (which must
/// already hold them, from `add_to_linker_sync`).
pub(crate) fn shadow_wasi_io(linker: &mut Linker<StoreState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let added =
        poll::add_to_linker::<StoreState, HasSandboxIo>(linker, |s| SandboxIo(s.table_mut()))
            .and_then(|()| {
                streams::add_to_linker::<StoreState, HasSandboxIo>(linker, |s| {
                    SandboxIo(s.table_mut())
                })
            });
    linker.allow_shadowing(false);
    added
}

/// Drive `op` to completion without blocking or entering a runtime, or refuse it.
/// Timer futures need a tokio context to be created in (not to be polled by a no-op waker), so
/// one is made current, as wasmtime-wasi does: entering a handle never blocks.
fn settle<T>(operation: &'static str, op: impl Future<Output = T>) -> Result<T, SandboxDenied> {
    wasmtime_wasi::runtime::with_ambient_tokio_runtime(|| {
        let mut op = pin!(op);
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..POLLS_BEFORE_BLOCKING {
            if let Poll::Ready(v) = op.as_mut().poll(&mut cx) {
                return Ok(v);
            }
        }
        Err(SandboxDenied { operation })
    })
}

fn settle_trap<T>(
    operation: &'static str,
    op: impl Future<Output = wasmtime::Result<T>>,
) -> wasmtime::Result<T> {
    settle(operation, op).map_err(wasmtime::Error::new)?
}

fn settle_stream<T>(
    operation: &'static str,
    op: impl Future<Output = StreamResult<T>>,
) -> StreamResult<T> {
    settle(operation, op).map_err(|e| StreamError::Trap(wasmtime::Error::new(e)))?
}

impl poll::Host for SandboxIo<'_> {
    fn poll(&mut self, pollables: Vec<Resource<DynPollable>>) -> wasmtime::Result<Vec<u32>> {
        settle_trap(
            "wasi:io/poll.poll",
            async_poll::Host::poll(self.0, pollables),
        )
    }
}

impl poll::HostPollable for SandboxIo<'_> {
    fn ready(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<bool> {
        settle_trap(
            "wasi:io/poll.pollable.ready",
            async_poll::HostPollable::ready(self.0, pollable),
        )
    }
    fn block(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        settle_trap(
            "wasi:io/poll.pollable.block",
            async_poll::HostPollable::block(self.0, pollable),
        )
    }
    fn drop(&mut self, pollable: Resource<DynPollable>) -> wasmtime::Result<()> {
        async_poll::HostPollable::drop(self.0, pollable)
    }
}

impl streams::Host for SandboxIo<'_> {
    fn convert_stream_error(&mut self, err: StreamError) -> wasmtime::Result<streams::StreamError> {
        Ok(async_streams::Host::convert_stream_error(self.0, err)?.into())
    }
}

impl streams::HostOutputStream for SandboxIo<'_> {
    fn drop(&mut self, stream: Resource<DynOutputStream>) -> wasmtime::Result<()> {
        settle_trap(
            "wasi:io/streams.output-stream.drop",
            AsyncOutputStream::drop(self.0, stream),
        )
    }
    fn check_write(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<u64> {
        AsyncOutputStream::check_write(self.0, stream)
    }
    fn write(&mut self, stream: Resource<DynOutputStream>, bytes: Vec<u8>) -> StreamResult<()> {
        AsyncOutputStream::write(self.0, stream, bytes)
    }
    fn blocking_write_and_flush(
        &mut self,
        stream: Resource<DynOutputStream>,
        bytes: Vec<u8>,
    ) -> StreamResult<()> {
        settle_stream(
            "wasi:io/streams.output-stream.blocking-write-and-flush",
            AsyncOutputStream::blocking_write_and_flush(self.0, stream, bytes),
        )
    }
    fn blocking_write_zeroes_and_flush(
        &mut self,
        stream: Resource<DynOutputStream>,
        len: u64,
    ) -> StreamResult<()> {
        settle_stream(
            "wasi:io/streams.output-stream.blocking-write-zeroes-and-flush",
            AsyncOutputStream::blocking_write_zeroes_and_flush(self.0, stream, len),
        )
    }
    fn subscribe(
        &mut self,
        stream: Resource<DynOutputStream>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        AsyncOutputStream::subscribe(self.0, stream)
    }
    fn write_zeroes(&mut self, stream: Resource<DynOutputStream>, len: u64) -> StreamResult<()> {
        AsyncOutputStream::write_zeroes(self.0, stream, len)
    }
    fn flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        AsyncOutputStream::flush(self.0, stream)
    }
    fn blocking_flush(&mut self, stream: Resource<DynOutputStream>) -> StreamResult<()> {
        settle_stream(
            "wasi:io/streams.output-stream.blocking-flush",
            AsyncOutputStream::blocking_flush(self.0, stream),
        )
    }
    fn splice(
        &mut self,
        dst: Resource<DynOutputStream>,
        src: Resource<DynInputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        AsyncOutputStream::splice(self.0, dst, src, len)
    }
    fn blocking_splice(
        &mut self,
        dst: Resource<DynOutputStream>,
        src: Resource<DynInputStream>,
        len: u64,
    ) -> StreamResult<u64> {
        settle_stream(
            "wasi:io/streams.output-stream.blocking-splice",
            AsyncOutputStream::blocking_splice(self.0, dst, src, len),
        )
    }
}

impl streams::HostInputStream for SandboxIo<'_> {
    fn drop(&mut self, stream: Resource<DynInputStream>) -> wasmtime::Result<()> {
        settle_trap(
            "wasi:io/streams.input-stream.drop",
            AsyncInputStream::drop(self.0, stream),
        )
    }
    fn read(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<Vec<u8>> {
        AsyncInputStream::read(self.0, stream, len)
    }
    fn blocking_read(
        &mut self,
        stream: Resource<DynInputStream>,
        len: u64,
    ) -> StreamResult<Vec<u8>> {
        settle_stream(
            "wasi:io/streams.input-stream.blocking-read",
            AsyncInputStream::blocking_read(self.0, stream, len),
        )
    }
    fn skip(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        AsyncInputStream::skip(self.0, stream, len)
    }
    fn blocking_skip(&mut self, stream: Resource<DynInputStream>, len: u64) -> StreamResult<u64> {
        settle_stream(
            "wasi:io/streams.input-stream.blocking-skip",
            AsyncInputStream::blocking_skip(self.0, stream, len),
        )
    }
    fn subscribe(
        &mut self,
        stream: Resource<DynInputStream>,
    ) -> wasmtime::Result<Resource<DynPollable>> {
        AsyncInputStream::subscribe(self.0, stream)
    }
}
