/** A phase duration the servers report in whole microseconds (truncated). */
export function fmtUs(us: number | null | undefined): string {
  if (us === null || us === undefined) return '—';
  if (us === 0) return '<1 µs';
  if (us < 1000) return `${us} µs`;
  if (us < 1_000_000) return `${(us / 1000).toFixed(us < 10_000 ? 2 : 1)} ms`;
  return `${(us / 1_000_000).toFixed(2)} s`;
}

export function fmtPps(pps: number | null | undefined): string {
  if (pps === null || pps === undefined) return '—';
  if (pps < 1000) return `${Math.round(pps)} pps`;
  if (pps < 1_000_000) return `${(pps / 1000).toFixed(1)} kpps`;
  return `${(pps / 1_000_000).toFixed(2)} Mpps`;
}

const pad = (n: number, width = 2) => String(n).padStart(width, '0');

/**
 * Local wall-clock time in 24-hour form, `HH:MM:SS`, or `HH:MM:SS.mmm` with
 * `millis` (the migration feed, where several start within one second).
 * Not `toLocaleTimeString`: in an en-US browser that is 12-hour with AM/PM.
 */
export function fmtTime(ms: number, millis = false): string {
  const d = new Date(ms);
  const hms = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  return millis ? `${hms}.${pad(d.getMilliseconds(), 3)}` : hms;
}

export function fmtDuration(ms: number): string {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  return `${Math.floor(m / 60)}h ${m % 60}m`;
}

const PALETTE = ['#2563eb', '#dc2626', '#16a34a', '#d97706', '#7c3aed', '#0891b2', '#db2777', '#65a30d', '#475569', '#ea580c'];
export function colorFor(id: number): string {
  return PALETTE[(id - 1) % PALETTE.length];
}
