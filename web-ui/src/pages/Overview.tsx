import { useEffect, useMemo, useState } from 'react';
import type { Drain, DrainMode, Migration, Server } from '../generated';
import type { PageProps } from '../App';
import { allows, problemText, toProblem } from '../api';
import type { Clients } from '../api';
import { LineChart } from '../components/LineChart';
import type { Series } from '../components/LineChart';
import { colorFor, fmtDuration, fmtPps, fmtTime, fmtUs } from '../format';

/** Per-server load and connections over time, server cards, the migration feed. */
export function Overview({ state, dispatch, clients, role }: PageProps) {
  const servers = useMemo(() => Object.values(state.servers).sort((a, b) => a.id - b.id), [state.servers]);

  const loadSeries: Series[] = useMemo(
    () =>
      servers.map((s) => ({
        label: s.name,
        color: colorFor(s.id),
        points: (state.history[s.id] ?? []).map((p) => ({ x: p.t, y: p.load_pps })),
      })),
    [servers, state.history],
  );
  const connSeries: Series[] = useMemo(
    () =>
      servers.map((s) => ({
        label: s.name,
        color: colorFor(s.id),
        points: (state.history[s.id] ?? []).map((p) => ({ x: p.t, y: p.connections })),
      })),
    [servers, state.history],
  );
  const loadKnown = loadSeries.some((s) => s.points.some((p) => p.y !== null));

  return (
    <div className="overview">
      <section className="charts">
        <div className="panel">
          <h2>Load per server</h2>
          {!loadKnown && (
            <p className="muted small" data-testid="load-unknown">
              No live load yet: the API reports load only while a switch control plane is connected
              (data source: {state.dataSource ?? 'unknown'}).
            </p>
          )}
          <LineChart series={loadSeries} yLabel="packets/s" testId="chart-load" />
        </div>
        <div className="panel">
          <h2>Connections per server</h2>
          <LineChart series={connSeries} yLabel="connections" testId="chart-connections" />
        </div>
      </section>

      <section>
        <h2>Servers</h2>
        {servers.length === 0 && <p className="muted">No server is registered.</p>}
        <div className="cards" data-testid="server-cards">
          {servers.map((s) => (
            <ServerCard key={s.id} server={s} clients={clients} operate={allows(role, 'operator')} onServer={(srv) => dispatch({ type: 'server', id: srv.id, server: srv })} onDrain={(d) => dispatch({ type: 'drain', drain: d })} />
          ))}
        </div>
      </section>

      <section className="panel">
        <h2>Migrations</h2>
        <MigrationFeed migrations={state.migrations} error={state.migrationsError} servers={state.servers} />
      </section>
    </div>
  );
}

function useNow(periodMs: number): number {
  const [now, setNow] = useState(Date.now());
  useEffect(() => {
    const t = window.setInterval(() => setNow(Date.now()), periodMs);
    return () => window.clearInterval(t);
  }, [periodMs]);
  return now;
}

function ServerCard({
  server: s,
  clients,
  operate,
  onServer,
  onDrain,
}: {
  server: Server;
  clients: Clients;
  /** The token may drain and re-weight (operator or admin). */
  operate: boolean;
  onServer: (s: Server) => void;
  onDrain: (d: Drain) => void;
}) {
  const [drainOpen, setDrainOpen] = useState(false);
  const [deadline, setDeadline] = useState('30');
  const [mode, setMode] = useState<DrainMode>('migrate');
  const [weight, setWeight] = useState(String(s.weight));
  const [weightDirty, setWeightDirty] = useState(false);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<string | null>(null);

  useEffect(() => {
    if (!weightDirty) setWeight(String(s.weight));
  }, [s.weight, weightDirty]);

  const deadlineNum = Number(deadline);
  const deadlineError =
    !/^\d+$/.test(deadline.trim()) || deadlineNum < 1 || deadlineNum > 86400 ? 'whole seconds, 1 to 86400' : null;
  const weightNum = Number(weight);
  const weightError = !/^\d+$/.test(weight.trim()) || weightNum > 65535 ? '0 to 65535' : null;

  const act = async (f: () => Promise<void>) => {
    setBusy(true);
    setError(null);
    try {
      await f();
    } catch (e) {
      setError(problemText(await toProblem(e)));
    } finally {
      setBusy(false);
    }
  };

  const startDrain = () =>
    act(async () => {
      const d = await clients.servers.drainServer({
        serverId: s.id,
        drainRequest: { deadline_seconds: deadlineNum, mode },
      });
      onDrain(d);
      // The server is `draining` now (or already `drained` if it had no
      // connection); re-read it rather than guess. Events keep it current.
      onServer(await clients.servers.getServer({ serverId: s.id }));
      setDrainOpen(false);
    });
  const undrain = () => act(async () => onServer(await clients.servers.undrainServer({ serverId: s.id })));
  const saveWeight = () =>
    act(async () => {
      onServer(await clients.servers.setServerWeight({ serverId: s.id, weightUpdate: { weight: weightNum } }));
      setWeightDirty(false);
    });
  const clearWeight = () =>
    act(async () => {
      await clients.servers.clearServerWeight({ serverId: s.id });
      setWeightDirty(false);
      onServer(await clients.servers.getServer({ serverId: s.id }));
    });
  const operatorWeight = s.weight_source === 'operator';

  const drainRunning = s.drain?.state === 'running';
  const canDrain = operate && s.state === 'active' && !drainRunning;
  const canUndrain = operate && (s.state === 'draining' || s.state === 'drained' || drainRunning);

  return (
    <div className={`card state-${s.state} liveness-${s.liveness}`} data-testid={`server-card-${s.id}`} data-server-name={s.name} data-state={s.state} data-liveness={s.liveness}>
      <div className="card-head">
        <span className="dot" style={{ background: colorFor(s.id) }} />
        <strong data-testid={`server-name-${s.id}`}>{s.name}</strong>
        <span className="muted small">#{s.id}</span>
        <span className={`badge badge-${s.state}`} data-testid={`server-state-${s.id}`}>
          {s.state}
        </span>
        {(s.liveness === 'never_seen' || (s.liveness === 'dead' && s.state !== 'dead')) && (
          <span
            className="badge badge-dead"
            title={
              s.liveness === 'never_seen'
                ? 'no hostagent has registered this server: it takes no connections'
                : 'its hostagent missed its heartbeats: no new connections'
            }
            data-testid={`server-liveness-${s.id}`}
          >
            {s.liveness === 'never_seen' ? 'never seen' : 'not heard'}
          </span>
        )}
        {s.liveness === 'stopping' && (
          <span
            className="badge badge-stopping"
            title="its hostagent is stopping: it migrates its connections away before it exits and takes no new connection"
            data-testid={`server-liveness-${s.id}`}
          >
            stopping · {s.stats.connections} left
          </span>
        )}
        {s.liveness === 'stopped' && (
          <span
            className="badge badge-stopped"
            title="its hostagent stopped cleanly: it holds no connection; it is placed again when its hostagent returns"
            data-testid={`server-liveness-${s.id}`}
          >
            stopped
          </span>
        )}
        {(s.stats.apps_down ?? 0) > 0 && (
          <span
            className="badge badge-draining"
            title="its application health checks report these services down: no new connections of them (docs/OPERATIONS.md, Application health checks)"
            data-testid={`server-apps-down-${s.id}`}
          >
            {s.stats.apps_down} app{s.stats.apps_down === 1 ? '' : 's'} down
          </span>
        )}
      </div>
      <dl className="stats">
        <dt>Connections</dt>
        <dd data-testid={`server-connections-${s.id}`}>{s.stats.connections}</dd>
        <dt>Load</dt>
        <dd data-testid={`server-load-${s.id}`} title={`data source: ${s.stats.data_source}`}>
          {fmtPps(s.stats.load_pps)}
        </dd>
        <dt>Weight</dt>
        <dd>
          <input
            className="weight"
            value={weight}
            readOnly={!operate}
            onChange={(e) => {
              setWeight(e.target.value);
              setWeightDirty(true);
            }}
            aria-invalid={weightError ? true : undefined}
            data-testid={`server-weight-${s.id}`}
          />
          {weightDirty && (
            <button className="small" disabled={busy || !!weightError} onClick={saveWeight} data-testid={`weight-save-${s.id}`}>
              Set
            </button>
          )}
          {weightDirty && weightError && <span className="field-error">{weightError}</span>}
          {!weightDirty && operatorWeight && (
            <>
              <span
                className="muted small"
                title="set by an operator: it applies over the weight the server's hostagent reports, also across its restarts, until cleared"
                data-testid={`weight-operator-${s.id}`}
              >
                {' '}
                operator{s.register_weight != null ? ` (reports ${s.register_weight})` : ''}
              </span>
              {operate && (
                <button className="small" disabled={busy} onClick={clearWeight} data-testid={`weight-clear-${s.id}`}>
                  Clear
                </button>
              )}
            </>
          )}
        </dd>
        <dt>Addresses</dt>
        <dd className="small">
          mgmt {s.mgmt_addr} · data {s.data_addr}
        </dd>
      </dl>

      {s.drain && <DrainProgress drain={s.drain} serverId={s.id} />}

      <div className="actions">
        {canDrain && !drainOpen && (
          <button disabled={busy} onClick={() => setDrainOpen(true)} data-testid={`drain-button-${s.id}`}>
            Drain…
          </button>
        )}
        {canUndrain && (
          <button disabled={busy} onClick={undrain} data-testid={`undrain-button-${s.id}`}>
            Undrain
          </button>
        )}
      </div>
      {drainOpen && (
        <div className="drain-form" data-testid={`drain-form-${s.id}`}>
          <label>
            Deadline (s)
            <input
              value={deadline}
              onChange={(e) => setDeadline(e.target.value)}
              aria-invalid={deadlineError ? true : undefined}
              data-testid={`drain-deadline-${s.id}`}
            />
          </label>
          <label>
            Mode
            <select value={mode} onChange={(e) => setMode(e.target.value as DrainMode)} data-testid={`drain-mode-${s.id}`}>
              <option value="migrate">migrate (never break a connection)</option>
              <option value="force">force (break what is left at the deadline)</option>
            </select>
          </label>
          {deadlineError && <div className="field-error">{deadlineError}</div>}
          <div className="actions">
            <button className="danger" disabled={busy || !!deadlineError} onClick={startDrain} data-testid={`drain-confirm-${s.id}`}>
              Start drain
            </button>
            <button className="link" onClick={() => setDrainOpen(false)}>
              Cancel
            </button>
          </div>
        </div>
      )}
      {error && (
        <div className="field-error" data-testid={`server-error-${s.id}`}>
          {error}
        </div>
      )}
    </div>
  );
}

function DrainProgress({ drain: d, serverId }: { drain: Drain; serverId: number }) {
  const now = useNow(1000);
  const p = d.progress;
  const done = p.flows_migrated + p.flows_closed;
  const pct = p.flows_total === 0 ? (d.state === 'running' ? 0 : 100) : Math.round((100 * done) / p.flows_total);
  const fullPct = d.state === 'completed' ? 100 : pct;
  return (
    <div className={`drain drain-${d.state}`} data-testid={`drain-progress-${serverId}`} data-drain-state={d.state} data-percent={fullPct}>
      <div className="drain-line">
        <span>
          Drain <strong data-testid={`drain-state-${serverId}`}>{d.state.replace('_', ' ')}</strong> ({d.mode})
        </span>
        <span className="muted small">
          {d.state === 'running'
            ? `deadline in ${fmtDuration(d.deadline_unix_ms - now)}`
            : `started ${fmtTime(d.started_unix_ms)}`}
        </span>
      </div>
      <div className="bar">
        <div className="bar-fill" style={{ width: `${fullPct}%` }} />
      </div>
      <div className="small" data-testid={`drain-counts-${serverId}`}>
        {p.flows_migrated} migrated · {p.flows_closed} closed · {p.flows_remaining} remaining of {p.flows_total}
      </div>
      {d.state === 'timed_out' && d.remaining.length > 0 && (
        <details className="small">
          <summary>
            {d.remaining.length}
            {d.remaining_truncated ? '+' : ''} connections still on the server
          </summary>
          <ul className="mono">
            {d.remaining.map((c) => (
              <li key={c}>{c}</li>
            ))}
          </ul>
        </details>
      )}
    </div>
  );
}

function MigrationFeed({
  migrations,
  error,
  servers,
}: {
  migrations: Migration[];
  error: string | null;
  servers: Record<number, Server>;
}) {
  const name = (id: number | null | undefined) => (id == null ? '—' : servers[id]?.name ?? `#${id}`);
  if (error && migrations.length === 0) {
    return (
      <p className="muted" data-testid="migration-feed-error">
        Migrations unavailable: {error}
      </p>
    );
  }
  return (
    <div className="feed-wrap">
      <table className="feed" data-testid="migration-feed" data-rows={migrations.length}>
        <thead>
          <tr>
            <th>#</th>
            <th>Started</th>
            <th>Connection</th>
            <th>Origin → target</th>
            <th>Trigger</th>
            <th>Outcome</th>
            <th title="PREPARE → PREPARE-ACK">Prepare</th>
            <th>Export</th>
            <th title="CONN-STATE → CONN-STATE-ACK">Transfer</th>
            <th>Import</th>
            <th>Total</th>
          </tr>
        </thead>
        <tbody>
          {migrations.length === 0 && (
            <tr>
              <td colSpan={11} className="muted">
                No migration yet.
              </td>
            </tr>
          )}
          {migrations.map((m) => (
            <tr key={m.id} className={`outcome-${m.outcome}`} data-testid={`migration-row-${m.id}`}>
              <td>{m.id}</td>
              <td className="mono" data-testid="migration-started">
                {fmtTime(m.started_unix_ms, true)}
              </td>
              <td className="mono">{m.connection}</td>
              <td>
                {name(m.origin)} → {name(m.target)}
              </td>
              <td>{m.trigger}</td>
              <td title={m.reason ?? ''}>{m.outcome.replace('_', ' ')}</td>
              <td data-testid="migration-prepare">{fmtUs(m.phases.prepare_us)}</td>
              <td data-testid="migration-export">{fmtUs(m.phases.export_us)}</td>
              <td data-testid="migration-transfer">{fmtUs(m.phases.transfer_us)}</td>
              <td data-testid="migration-import">{fmtUs(m.phases.import_us)}</td>
              <td>
                <strong>{fmtUs(m.phases.total_us)}</strong>
              </td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}
