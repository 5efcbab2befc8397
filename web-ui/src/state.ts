// The dashboard's live model: filled by listing the REST resources when the
// event stream (re)opens, then kept current by the stream's events.
import type { DataSource, Drain, LoadEvent, Migration, Policy, Server, ServiceView } from './generated';

/** One sample of a server's load, from a `load` event or a server listing. */
export interface LoadPoint {
  t: number; // unix ms
  connections: number;
  load_pps: number | null;
}

export type StreamStatus = 'connecting' | 'live' | 'reconnecting';

export interface State {
  servers: Record<number, Server>;
  services: Record<string, ServiceView>;
  policy: Policy | null;
  /** Bumped on every policy seen from the server (list or event). */
  policySeq: number;
  /** Newest first. */
  migrations: Migration[];
  migrationsError: string | null;
  history: Record<number, LoadPoint[]>;
  dataSource: DataSource | null;
  stream: StreamStatus;
  lastEventAt: number | null;
}

/** Five minutes of one-second load events. */
export const HISTORY_POINTS = 300;
export const FEED_LENGTH = 100;

export const initialState: State = {
  servers: {},
  services: {},
  policy: null,
  policySeq: 0,
  migrations: [],
  migrationsError: null,
  history: {},
  dataSource: null,
  stream: 'connecting',
  lastEventAt: null,
};

export type Action =
  | { type: 'servers'; items: Server[]; at: number }
  | { type: 'server'; id: number; server: Server | null }
  | { type: 'drain'; drain: Drain }
  | { type: 'load'; event: LoadEvent }
  | { type: 'services'; items: ServiceView[] }
  | { type: 'service'; name: string; service: ServiceView | null }
  | { type: 'policy'; policy: Policy }
  | { type: 'migrations'; items: Migration[] }
  | { type: 'migrationsError'; message: string }
  | { type: 'migration'; migration: Migration }
  | { type: 'stream'; status: StreamStatus }
  | { type: 'event' };

function pushPoint(history: State['history'], id: number, p: LoadPoint): State['history'] {
  const old = history[id] ?? [];
  const last = old[old.length - 1];
  // A listing and a load event of the same second: keep the later one.
  const base = last && p.t - last.t < 500 ? old.slice(0, -1) : old;
  const next = base.length >= HISTORY_POINTS ? base.slice(base.length - HISTORY_POINTS + 1) : base.slice();
  next.push(p);
  return { ...history, [id]: next };
}

export function reducer(state: State, a: Action): State {
  switch (a.type) {
    case 'servers': {
      const servers: State['servers'] = {};
      let history: State['history'] = {};
      for (const s of a.items) {
        servers[s.id] = s;
        history[s.id] = state.history[s.id] ?? [];
        history = pushPoint(history, s.id, {
          t: a.at,
          connections: s.stats.connections,
          load_pps: s.stats.load_pps ?? null,
        });
      }
      const ds = a.items.length ? a.items[0].stats.data_source : state.dataSource;
      return { ...state, servers, history, dataSource: ds };
    }
    case 'server': {
      const servers = { ...state.servers };
      const history = { ...state.history };
      if (a.server) {
        // A response and an event can cross: never go back to an older copy.
        const cur = servers[a.id];
        if (cur && cur.updated_unix_ms > a.server.updated_unix_ms) return state;
        servers[a.id] = a.server;
      } else {
        delete servers[a.id];
        delete history[a.id];
      }
      return { ...state, servers, history };
    }
    case 'drain': {
      const s = state.servers[a.drain.server];
      if (!s) return state;
      return { ...state, servers: { ...state.servers, [s.id]: { ...s, drain: a.drain } } };
    }
    case 'load': {
      const ev = a.event;
      let history = state.history;
      const servers = { ...state.servers };
      for (const l of ev.servers) {
        const s = servers[l.id];
        if (!s) continue; // Not listed yet; the next `server` event or listing adds it.
        servers[l.id] = {
          ...s,
          stats: { ...s.stats, connections: l.connections, load_pps: l.load_pps ?? null, data_source: ev.data_source },
        };
        history = pushPoint(history, l.id, { t: ev.at_unix_ms, connections: l.connections, load_pps: l.load_pps ?? null });
      }
      return { ...state, servers, history, dataSource: ev.data_source };
    }
    case 'services': {
      const services: State['services'] = {};
      for (const s of a.items) services[s.name] = s;
      return { ...state, services };
    }
    case 'service': {
      const services = { ...state.services };
      // A store event has no switchd view: keep the last one until the
      // page's next re-list.
      if (a.service) services[a.name] = { serving: state.services[a.name]?.serving, ...a.service };
      else delete services[a.name];
      return { ...state, services };
    }
    case 'policy':
      return { ...state, policy: a.policy, policySeq: state.policySeq + 1 };
    case 'migrations': {
      // The listing is the newest FEED_LENGTH (`order=desc`); the feed is
      // newest first. A listed entry replaces the one held (it is as new);
      // events newer than the listing are kept.
      const byId = new Map<number, Migration>();
      for (const m of a.items) byId.set(m.id, m);
      for (const m of state.migrations) if (!byId.has(m.id)) byId.set(m.id, m);
      const migrations = Array.from(byId.values()).sort((x, y) => y.id - x.id).slice(0, FEED_LENGTH);
      return { ...state, migrations, migrationsError: null };
    }
    case 'migrationsError':
      return { ...state, migrationsError: a.message };
    case 'migration': {
      const rest = state.migrations.filter((m) => m.id !== a.migration.id);
      const migrations = [a.migration, ...rest].sort((x, y) => y.id - x.id).slice(0, FEED_LENGTH);
      return { ...state, migrations };
    }
    case 'stream':
      return { ...state, stream: a.status };
    case 'event':
      return { ...state, lastEventAt: Date.now() };
  }
}
