//! The glue that moves frames between a [`Device`] and an [`Interface`].
//!
//! This is the only place in the crate that reads a clock: it turns the
//! monotonic clock into the stack's `Instant` (microseconds since the
//! driver's epoch) and passes it down. One `poll` is one receive batch, due
//! timers, and one transmit batch; in `Sleep` mode `run` then sleeps in the
//! device until a frame arrives or the stack's next deadline.

use crate::device::{Device, DeviceError, PollMode};
use crate::iface::{Interface, Transport};
use capybara_proto::time::{Duration, Instant};

/// Frames handled by one `poll`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PollResult {
    pub received: usize,
    pub transmitted: usize,
}

/// Driver settings.
#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// Frames per receive and per transmit batch.
    pub batch: usize,
    pub mode: PollMode,
    /// Longest sleep in `Sleep` mode, so `run` notices its stop condition.
    pub max_sleep: Duration,
}

impl Default for DriverConfig {
    fn default() -> Self {
        DriverConfig {
            batch: 32,
            mode: PollMode::Sleep,
            max_sleep: Duration::from_millis(10),
        }
    }
}

/// Maps the monotonic clock onto `Instant`.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: std::time::Instant,
}

impl Clock {
    pub fn new() -> Self {
        Clock {
            epoch: std::time::Instant::now(),
        }
    }
    pub fn now(&self) -> Instant {
        Instant::from_micros(self.epoch.elapsed().as_micros().min(u128::from(u64::MAX)) as u64)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// One receive batch, due timers, one transmit batch.
pub fn poll<D, T>(
    now: Instant,
    iface: &mut Interface,
    device: &mut D,
    transport: &mut T,
    batch: usize,
) -> Result<PollResult, DeviceError>
where
    D: Device + ?Sized,
    T: Transport + ?Sized,
{
    let received = device.receive(batch, &mut |frame| iface.receive(now, frame, transport))?;
    if iface.poll_timeout(transport).is_some_and(|t| t <= now) {
        iface.handle_timeout(now, transport);
    }
    let transmitted = device.transmit(batch, &mut |buf| iface.transmit(now, buf, transport))?;
    Ok(PollResult {
        received,
        transmitted,
    })
}

/// Polls until `stop()` returns true, sleeping between batches in `Sleep`
/// mode. Returns the first device error.
pub fn run<D, T>(
    config: &DriverConfig,
    clock: &Clock,
    iface: &mut Interface,
    device: &mut D,
    transport: &mut T,
    mut stop: impl FnMut(&Interface, &T) -> bool,
) -> Result<(), DeviceError>
where
    D: Device + ?Sized,
    T: Transport + ?Sized,
{
    while !stop(iface, transport) {
        let now = clock.now();
        let r = poll(now, iface, device, transport, config.batch)?;
        if config.mode == PollMode::Sleep
            && r.received < config.batch
            && r.transmitted < config.batch
        {
            let wake = iface.poll_timeout(transport);
            let sleep = match wake {
                Some(t) => t.saturating_since(clock.now()).min(config.max_sleep),
                None => config.max_sleep,
            };
            if !sleep.is_zero() {
                device.wait(Some(sleep))?;
            }
        }
    }
    Ok(())
}
