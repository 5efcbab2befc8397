import { useCallback, useEffect, useMemo, useReducer, useState } from 'react';
import { clearToken, makeClients, problemText, storedToken, storeToken, takeLogoutReason, toProblem } from './api';
import type { Clients, Role } from './api';
import { useEventStream } from './events';
import { FEED_LENGTH, initialState, reducer } from './state';
import type { Action, State } from './state';
import { Login } from './pages/Login';
import { Overview } from './pages/Overview';
import { PolicyPage } from './pages/Policy';
import { ServicesPage } from './pages/Services';

type Page = 'overview' | 'policy' | 'services';
const PAGES: { id: Page; label: string }[] = [
  { id: 'overview', label: 'Overview' },
  { id: 'policy', label: 'Policy' },
  { id: 'services', label: 'Services' },
];

function pageFromHash(): Page {
  const h = window.location.hash.replace(/^#\/?/, '');
  return (PAGES.find((p) => p.id === h)?.id ?? 'overview') as Page;
}

export function App() {
  const [token, setToken] = useState<string | null>(storedToken());
  const [loginMessage, setLoginMessage] = useState<string | null>(takeLogoutReason());

  const logout = useCallback((message?: string) => {
    clearToken();
    setLoginMessage(message ?? null);
    setToken(null);
  }, []);

  if (!token) {
    return (
      <Login
        message={loginMessage}
        onLogin={(t) => {
          storeToken(t);
          setLoginMessage(null);
          setToken(t);
        }}
      />
    );
  }
  return <Dashboard key={token} token={token} onLogout={logout} />;
}

export interface PageProps {
  state: State;
  dispatch: (a: Action) => void;
  clients: Clients;
  /** The signed-in token's role (null until /v1/whoami answers). */
  role: Role | null;
}

function Dashboard({ token, onLogout }: { token: string; onLogout: (message?: string) => void }) {
  const [state, dispatch] = useReducer(reducer, initialState);
  const [page, setPage] = useState<Page>(pageFromHash());
  const [error, setError] = useState<string | null>(null);
  // Completed re-lists (exposed for tests as `data-syncs`).
  const [syncs, setSyncs] = useState(0);
  const [me, setMe] = useState<{ name: string; role: Role } | null>(null);

  const clients = useMemo(
    () => makeClients(token, (msg) => onLogout(`Signed out: ${msg}`)),
    [token, onLogout],
  );

  useEffect(() => {
    const onHash = () => setPage(pageFromHash());
    window.addEventListener('hashchange', onHash);
    return () => window.removeEventListener('hashchange', onHash);
  }, []);

  const resync = useCallback(async () => {
    const at = Date.now();
    const results = await Promise.allSettled([
      clients.servers.listServers().then((l) => dispatch({ type: 'servers', items: l.items, at })),
      clients.services.listServices().then((l) => dispatch({ type: 'services', items: l.items })),
      clients.policy.getPolicy().then((p) => dispatch({ type: 'policy', policy: p })),
    ]);
    // The newest FEED_LENGTH (the API lists oldest first by default). Migrations
    // may be unavailable (503) without a data plane; that is not fatal.
    await clients.migrations
      .listMigrations({ limit: FEED_LENGTH, order: 'desc' })
      .then((l) => dispatch({ type: 'migrations', items: l.items }))
      .catch(async (e) => dispatch({ type: 'migrationsError', message: problemText(await toProblem(e)) }));
    setSyncs((n) => n + 1);
    const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    setError(failed ? problemText(await toProblem(failed.reason)) : null);
  }, [clients]);

  const probe = useCallback(() => {
    // A 401 here signs out through the client's middleware.
    clients.servers.listServers().catch(() => undefined);
  }, [clients]);

  useEffect(() => {
    clients.tokens
      .whoami()
      .then((t) => setMe({ name: t.name, role: t.role as Role }))
      .catch(() => undefined); // a 401 signs out through the middleware
  }, [clients]);

  useEventStream(token, { dispatch, resync, probe });

  const props: PageProps = { state, dispatch, clients, role: me?.role ?? null };
  return (
    <div className="app">
      <header className="topbar">
        <span className="brand">Capybara</span>
        <nav>
          {PAGES.map((p) => (
            <a
              key={p.id}
              href={`#/${p.id}`}
              className={p.id === page ? 'active' : ''}
              data-testid={`nav-${p.id}`}
            >
              {p.label}
            </a>
          ))}
        </nav>
        <span className={`stream stream-${state.stream}`} data-testid="stream-status" data-status={state.stream} data-syncs={syncs}>
          {state.stream === 'live' ? 'live' : state.stream === 'connecting' ? 'connecting…' : 'reconnecting…'}
        </span>
        {state.dataSource && (
          <span className="datasource" data-testid="data-source" title="Where live data comes from">
            data: {state.dataSource}
          </span>
        )}
        {me && (
          <span className="whoami" data-testid="whoami" data-role={me.role} title="The signed-in token">
            {me.name} ({me.role})
          </span>
        )}
        <button className="link" data-testid="logout" onClick={() => onLogout()}>
          Sign out
        </button>
      </header>
      {error && (
        <div className="banner error" data-testid="global-error">
          {error}
        </div>
      )}
      <main>
        {page === 'overview' && <Overview {...props} />}
        {page === 'policy' && <PolicyPage {...props} />}
        {page === 'services' && <ServicesPage {...props} />}
      </main>
    </div>
  );
}
