import { useEffect, useRef } from 'react';
import {
  Chart,
  Legend,
  LinearScale,
  LineController,
  LineElement,
  PointElement,
  Tooltip,
} from 'chart.js';
import { fmtTime } from '../format';

Chart.register(LineController, LineElement, PointElement, LinearScale, Legend, Tooltip);

export interface Series {
  label: string;
  color: string;
  points: { x: number; y: number | null }[];
}

/** A tick step of whole seconds (or minutes) near `ms`, so labels never repeat. */
function niceStep(ms: number): number {
  for (const s of [1, 2, 5, 10, 15, 30, 60, 120, 300, 600]) if (s * 1000 >= ms) return s * 1000;
  return 600_000;
}

/**
 * A Chart.js line chart over wall-clock time. The chart is created once and
 * updated in place (no animation) when `series` changes.
 */
export function LineChart({
  series,
  yLabel,
  testId,
  windowMs = 5 * 60_000,
}: {
  series: Series[];
  yLabel: string;
  testId: string;
  windowMs?: number;
}) {
  const canvas = useRef<HTMLCanvasElement>(null);
  const chart = useRef<Chart<'line', { x: number; y: number | null }[]> | null>(null);

  useEffect(() => {
    chart.current = new Chart(canvas.current!, {
      type: 'line',
      data: { datasets: [] },
      options: {
        animation: false,
        responsive: true,
        maintainAspectRatio: false,
        parsing: false,
        spanGaps: false,
        interaction: { mode: 'nearest', axis: 'x', intersect: false },
        elements: { point: { radius: 0 }, line: { borderWidth: 2, tension: 0.2 } },
        scales: {
          x: { type: 'linear', ticks: { callback: (v) => fmtTime(Number(v)), maxTicksLimit: 6 } },
          y: { type: 'linear', beginAtZero: true, title: { display: true, text: yLabel } },
        },
        plugins: {
          legend: { position: 'bottom' },
          tooltip: { callbacks: { title: (items) => (items.length ? fmtTime(items[0].parsed.x) : '') } },
        },
      },
    });
    return () => {
      chart.current?.destroy();
      chart.current = null;
    };
  }, [yLabel]);

  useEffect(() => {
    const c = chart.current;
    if (!c) return;
    // A sliding window ending at the newest sample, so the time axis has
    // round ticks and the chart scrolls instead of stretching.
    // Until the window is full, it spans the samples there are.
    let newest = 0;
    let oldest = Infinity;
    for (const s of series) {
      if (!s.points.length) continue;
      newest = Math.max(newest, s.points[s.points.length - 1].x);
      oldest = Math.min(oldest, s.points[0].x);
    }
    const x = c.options.scales!.x! as any;
    if (newest) {
      const span = Math.max(1000, Math.min(windowMs, newest - oldest));
      x.min = newest - span;
      x.max = newest;
      x.ticks.stepSize = niceStep(span / 5);
    } else {
      x.min = x.max = x.ticks.stepSize = undefined;
    }
    c.data.datasets = series.map((s) => ({
      label: s.label,
      data: s.points,
      borderColor: s.color,
      backgroundColor: s.color,
    }));
    c.update('none');
  }, [series, windowMs]);

  const points = series.reduce((n, s) => n + s.points.filter((p) => p.y !== null).length, 0);
  return (
    <div className="chart" data-testid={testId} data-series={series.length} data-points={points}>
      <canvas ref={canvas} />
    </div>
  );
}
