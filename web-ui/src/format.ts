export function fmtUs(us: number | null | undefined): string {
  if (us === null || us === undefined) return '—';
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

export function fmtTime(ms: number): string {
  return new Date(ms).toLocaleTimeString();
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
