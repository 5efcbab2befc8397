//! Batched frame I/O.
//!
//! A [`Device`] moves whole Ethernet frames (no FCS) in batches: `receive`
//! lends the caller up to `max` frames straight from device memory (an mmap'ed
//! ring, a DPDK mbuf), `transmit` lends free device buffers for the caller to
//! fill and hands the filled ones to the hardware/kernel with one call per
//! batch. The stack above never owns frame memory, so the per-packet path
//! copies nothing and allocates nothing.
//!
//! Invariants for every backend:
//! - a frame slice passed to the callback is valid only during that call;
//! - `transmit` flushes what was filled before returning (one syscall or
//!   burst per batch), even if the callback stopped early;
//! - frames the device itself transmitted are never returned by `receive`.

pub mod af_packet;
#[cfg(feature = "dpdk")]
pub mod dpdk;
pub mod kernel_drop;
pub mod memory;

use crate::latency::LatencyHistogram;
use crate::wire::EthernetAddress;
use capybara_proto::time::Duration;
use std::os::fd::RawFd;

/// I/O errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("{op} on {interface}: {source}")]
    Io {
        op: &'static str,
        interface: String,
        source: std::io::Error,
    },
    #[error("interface {0:?} not found")]
    NoSuchInterface(String),
    #[error("invalid device configuration: {0}")]
    Config(String),
    #[error("dpdk: {0}")]
    Dpdk(String),
}

/// Whether the driver spins on `receive` or sleeps in `wait` when idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Never sleep: lowest latency, one core at 100%.
    BusyPoll,
    /// Sleep in `Device::wait` until a frame arrives or the stack's next
    /// deadline.
    #[default]
    Sleep,
}

/// A batched frame device. See the module documentation.
pub trait Device {
    /// Calls `f` once for each of at most `max` received frames, in arrival
    /// order, and returns how many were delivered. Never blocks.
    fn receive(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, DeviceError>;

    /// Offers at most `max` free transmit buffers, one at a time, to `f`,
    /// which writes a frame at the start and returns its length, or `None`
    /// when it has nothing more. Filled frames are then sent in one batch.
    /// Returns the number of frames queued. Never blocks.
    fn transmit(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> Result<usize, DeviceError>;

    /// Blocks until a frame may be ready to receive or `timeout` elapses
    /// (`None`: no timeout). Spurious wake-ups are allowed.
    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), DeviceError>;

    /// A descriptor that becomes readable when frames arrive, for drivers
    /// that multiplex several sources (epoll/tokio). `None` if the backend
    /// has none (DPDK polls, the memory link uses a condition variable).
    fn raw_fd(&self) -> Option<RawFd> {
        None
    }

    /// The hardware address of the underlying port, if it has one.
    fn mac(&self) -> Option<EthernetAddress>;

    /// How long the first frame of each receive batch waited between the
    /// kernel putting it in the ring and the driver handling it (the
    /// driver's wake-up delay), if the backend timestamps frames.
    fn rx_delay(&self) -> Option<&LatencyHistogram> {
        None
    }

    /// How long each transmit batch's kick (the system call that hands the
    /// batch to the kernel) took, if the backend measures it.
    fn tx_kick(&self) -> Option<&LatencyHistogram> {
        None
    }

    /// Largest frame a transmit buffer holds (Ethernet header included).
    fn max_frame_len(&self) -> usize;
}

impl<D: Device + ?Sized> Device for Box<D> {
    fn receive(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Result<usize, DeviceError> {
        (**self).receive(max, f)
    }
    fn transmit(
        &mut self,
        max: usize,
        f: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) -> Result<usize, DeviceError> {
        (**self).transmit(max, f)
    }
    fn wait(&mut self, timeout: Option<Duration>) -> Result<(), DeviceError> {
        (**self).wait(timeout)
    }
    fn raw_fd(&self) -> Option<RawFd> {
        (**self).raw_fd()
    }
    fn mac(&self) -> Option<EthernetAddress> {
        (**self).mac()
    }
    fn rx_delay(&self) -> Option<&LatencyHistogram> {
        (**self).rx_delay()
    }
    fn tx_kick(&self) -> Option<&LatencyHistogram> {
        (**self).tx_kick()
    }
    fn max_frame_len(&self) -> usize {
        (**self).max_frame_len()
    }
}
