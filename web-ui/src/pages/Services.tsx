import { useEffect, useMemo, useState } from 'react';
import type { FormEvent } from 'react';
import type { RetiringService, Server, Service, ServiceView } from '../generated';
import type { PageProps } from '../App';
import { allows, problemText, toProblem } from '../api';
import { fmtDuration } from '../format';

const NAME = /^[A-Za-z0-9_.-]{1,64}$/;
const IPV4 = /^(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}$/;

interface Draft {
  name: string;
  vip: string;
  port: string;
  pool: number[];
}

function checkDraft(d: Draft, isNew: boolean): Record<string, string> {
  const e: Record<string, string> = {};
  if (isNew && !NAME.test(d.name)) e.name = 'letters, digits, _ . - (1 to 64)';
  if (!IPV4.test(d.vip.trim())) e.vip = 'an IPv4 address';
  const port = Number(d.port);
  if (!/^\d+$/.test(d.port.trim()) || port < 1 || port > 65535) e.port = '1 to 65535';
  return e;
}

/** Services: VIP:port and the pool of servers behind each. */
export function ServicesPage({ state, clients, dispatch, role }: PageProps) {
  const admin = allows(role, 'admin');
  const services = useMemo(() => Object.values(state.services).sort((a, b) => a.name.localeCompare(b.name)), [state.services]);
  const servers = useMemo(() => Object.values(state.servers).sort((a, b) => a.id - b.id), [state.servers]);
  const [editing, setEditing] = useState<string | null>(null); // service name, or '' for a new one
  const [error, setError] = useState<string | null>(null);
  // Deleted services switchd still serves connections of (undefined:
  // switchd did not answer, or not listed yet).
  const [retiring, setRetiring] = useState<RetiringService[] | undefined>(undefined);

  // What the data plane does with each service (switchd's view), and which
  // deleted ones still retire, change without a store event: list at once
  // and every 2 s while the page is open.
  useEffect(() => {
    const list = () =>
      clients.services.listServices().then(
        (l) => {
          dispatch({ type: 'services', items: l.items });
          setRetiring(l.retiring);
        },
        () => {},
      );
    list();
    const t = window.setInterval(list, 2000);
    return () => window.clearInterval(t);
  }, [clients, dispatch]);

  const remove = async (name: string) => {
    if (
      !window.confirm(
        `Delete service ${name}?\n\nNew connections to it are no longer accepted (within a second). Its open connections are kept until they end, ` +
          `at most switchd's service_retire_timeout_ms (5 minutes by default); then the rest are closed.`,
      )
    )
      return;
    setError(null);
    try {
      await clients.services.deleteService({ serviceName: name });
      dispatch({ type: 'service', name, service: null });
    } catch (e) {
      setError(problemText(await toProblem(e)));
    }
  };

  return (
    <div className="panel services">
      <h2>Services</h2>
      <p className="muted small">Each service is a VIP:port owned by the switch and a pool of servers. Creating, changing and deleting services needs an admin token.</p>
      {error && <div className="banner error" data-testid="services-error">{error}</div>}
      <table className="feed" data-testid="services-table">
        <thead>
          <tr>
            <th>Name</th>
            <th>VIP:port</th>
            <th>Pool</th>
            <th>Data plane</th>
            <th />
          </tr>
        </thead>
        <tbody>
          {services.length === 0 && (
            <tr>
              <td colSpan={5} className="muted">
                No service yet.
              </td>
            </tr>
          )}
          {services.map((svc) =>
            editing === svc.name ? (
              <tr key={svc.name}>
                <td colSpan={5}>
                  <ServiceForm service={svc} servers={servers} clients={clients} onDone={(s) => { if (s) dispatch({ type: 'service', name: s.name, service: s }); setEditing(null); }} />
                </td>
              </tr>
            ) : (
              <tr key={svc.name} data-testid={`service-row-${svc.name}`}>
                <td><strong>{svc.name}</strong></td>
                <td className="mono">{svc.vip}:{svc.port}</td>
                <td>
                  <Pool pool={svc.pool} servers={state.servers} />
                </td>
                <td data-testid={`service-serving-${svc.name}`}>
                  <Serving svc={svc} servers={state.servers} />
                </td>
                <td className="actions">
                  {admin && <>
                  <button className="small" onClick={() => setEditing(svc.name)} data-testid={`service-edit-${svc.name}`}>Edit</button>
                  <button className="small danger" onClick={() => remove(svc.name)} data-testid={`service-delete-${svc.name}`}>Delete</button>
                  </>}
                </td>
              </tr>
            ),
          )}
        </tbody>
      </table>
      {editing === '' ? (
        <ServiceForm servers={servers} clients={clients} onDone={(s) => { if (s) dispatch({ type: 'service', name: s.name, service: s }); setEditing(null); }} />
      ) : admin && (
        <div className="actions">
          <button onClick={() => setEditing('')} data-testid="service-new">New service…</button>
        </div>
      )}
      {retiring && retiring.length > 0 && <Retiring items={retiring} />}
    </div>
  );
}

/** Deleted services whose open connections switchd still serves. */
function Retiring({ items }: { items: RetiringService[] }) {
  return (
    <section className="retiring" data-testid="retiring-section">
      <h3>Retiring</h3>
      <p className="muted small">
        Deleted services: no new connections; their open connections are still served (and migrated) until they end, at most switchd's
        service_retire_timeout_ms after the delete (5 minutes by default), when the rest are closed. Creating a service at the same VIP:port
        before then serves them again.
      </p>
      <table className="feed" data-testid="retiring-table">
        <thead>
          <tr>
            <th>Name</th>
            <th>VIP:port</th>
            <th>Connections left</th>
            <th>Deleted</th>
            <th>Timeout in</th>
          </tr>
        </thead>
        <tbody>
          {items.map((r) => (
            <tr key={`${r.name} ${r.vip}:${r.port}`} data-testid={`retiring-row-${r.name}`}>
              <td><strong>{r.name}</strong></td>
              <td className="mono">{r.vip}:{r.port}</td>
              <td data-testid={`retiring-connections-${r.name}`}>
                {r.connections ?? <span className="muted" title="switchd has not counted its connections yet (within a second)">counting…</span>}
              </td>
              <td data-testid={`retiring-for-${r.name}`} title={`${r.retiring_for_ms} ms`}>{fmtDuration(r.retiring_for_ms)} ago</td>
              <td data-testid={`retiring-left-${r.name}`}>
                {r.timeout_in_ms != null ? fmtDuration(r.timeout_in_ms) : <span className="muted" title="switchd does not report its retire timeout">—</span>}
              </td>
            </tr>
          ))}
        </tbody>
      </table>
    </section>
  );
}

/** A pool member's colour: its state while its hostagent is heard, its
 * liveness otherwise (a stop in progress or done is not a death). */
function poolChipStyle(s: Server): string {
  switch (s.liveness) {
    case 'live':
      return s.state;
    case 'stopping':
    case 'stopped':
      return s.liveness;
    default:
      return 'dead';
  }
}

function Pool({ pool: poolSet, servers }: { pool: Set<number>; servers: Record<number, Server> }) {
  const pool = Array.from(poolSet).sort((a, b) => a - b);
  if (pool.length === 0) return <span className="muted">every server</span>;
  return (
    <span className="pool">
      {pool.map((id) => {
        const s = servers[id];
        return (
          <span
            key={id}
            className={`chip badge-${s ? poolChipStyle(s) : 'dead'}`}
            title={s ? `${s.state}, ${s.liveness.replace('_', ' ')}, weight ${s.weight}` : 'unknown server'}
          >
            {s?.name ?? `#${id}`}
          </span>
        );
      })}
    </span>
  );
}

function ServiceForm({
  service,
  servers,
  clients,
  onDone,
}: {
  service?: Service;
  servers: Server[];
  clients: PageProps['clients'];
  onDone: (s: Service | null) => void;
}) {
  const isNew = !service;
  const [d, setD] = useState<Draft>({
    name: service?.name ?? '',
    vip: service?.vip ?? '',
    port: service ? String(service.port) : '',
    pool: service ? Array.from(service.pool).sort((a, b) => a - b) : [],
  });
  const [serverErrors, setServerErrors] = useState<Record<string, string>>({});
  const [error, setError] = useState<string | null>(null);
  const [submitted, setSubmitted] = useState(false);
  const errors = { ...(submitted ? checkDraft(d, isNew) : {}), ...serverErrors };

  const submit = async (e: FormEvent) => {
    e.preventDefault();
    setSubmitted(true);
    if (Object.keys(checkDraft(d, isNew)).length) return;
    setError(null);
    setServerErrors({});
    try {
      // The generated models hold `uniqueItems` arrays as Sets.
      const body = { vip: d.vip.trim(), port: Number(d.port), pool: new Set(d.pool) };
      const saved = isNew
        ? await clients.services.createService({ service: { name: d.name, ...body } })
        : await clients.services.updateService({ serviceName: service!.name, serviceUpdate: body });
      onDone(saved);
    } catch (err) {
      const p = await toProblem(err);
      if (p.field) setServerErrors({ [p.field.split(/[.[]/)[0]]: p.detail || p.title });
      setError(problemText(p));
    }
  };

  // Registered servers, plus pool members that are no longer registered
  // (removed while the form was open), so the operator sees and can drop them.
  // Unchecking one keeps it listed, so the list does not jump.
  const [seen, setSeen] = useState<number[]>(d.pool);
  const known = new Set(servers.map((s) => s.id));
  const choices = [
    ...servers.map((s) => ({ id: s.id, label: s.name })),
    ...seen.filter((id) => !known.has(id)).map((id) => ({ id, label: `#${id} (not registered)` })),
  ];

  const toggle = (id: number) => {
    if (!seen.includes(id)) setSeen([...seen, id]);
    toggleDraft(id);
  };
  const toggleDraft = (id: number) => setD({ ...d, pool: d.pool.includes(id) ? d.pool.filter((x) => x !== id) : [...d.pool, id].sort((a, b) => a - b) });

  return (
    <form className="service-form" onSubmit={submit} noValidate data-testid="service-form">
      {isNew && (
        <label>
          Name
          <input value={d.name} onChange={(e) => setD({ ...d, name: e.target.value })} data-testid="service-field-name" />
          {errors.name && <span className="field-error" data-testid="service-error-name">{errors.name}</span>}
        </label>
      )}
      <label>
        VIP
        <input value={d.vip} onChange={(e) => setD({ ...d, vip: e.target.value })} placeholder="10.0.0.100" data-testid="service-field-vip" />
        {errors.vip && <span className="field-error" data-testid="service-error-vip">{errors.vip}</span>}
      </label>
      <label>
        Port
        <input value={d.port} onChange={(e) => setD({ ...d, port: e.target.value })} placeholder="80" data-testid="service-field-port" />
        {errors.port && <span className="field-error" data-testid="service-error-port">{errors.port}</span>}
      </label>
      <fieldset>
        <legend>Pool</legend>
        {choices.length === 0 && <span className="muted">No server registered.</span>}
        {choices.map(({ id, label }) => (
          <label key={id} className="inline" data-testid={`service-pool-label-${id}`}>
            <input type="checkbox" checked={d.pool.includes(id)} onChange={() => toggle(id)} data-testid={`service-pool-${id}`} />
            {label}
          </label>
        ))}
        {errors.pool && <span className="field-error" data-testid="service-error-pool">{errors.pool}</span>}
      </fieldset>
      {error && <div className="field-error" data-testid="service-form-error">{error}</div>}
      <div className="actions">
        <button type="submit" data-testid="service-save">{isNew ? 'Create' : 'Save'}</button>
        <button type="button" className="link" onClick={() => onDone(null)}>Cancel</button>
      </div>
    </form>
  );
}

/** The pending chip's explanation: ctl's words (api/src/ctl.rs SERVICE_PENDING). */
const SERVICE_PENDING = "switchd applies it within 1 s (if it stays pending, see switchd's log)";

/** switchd's view: served or not, its pool, apps down; solid chips take
 *  new connections (`placing`), outlined ones do not (drained, leaving,
 *  weight 0, dead...). A switchd too old to say `placing`: all solid. */
function Serving({ svc, servers }: { svc: ServiceView; servers: Record<number, Server> }) {
  const v = svc.serving;
  if (!v) return <span className="muted" title="switchd did not answer: the store's record only" data-served="unknown">unknown</span>;
  // switchd read it and will not serve it (a VIP:port or name another
  // stored service has, no free slot): red with its reason, as `capybara
  // ctl services` prints "refused: REASON". It stays so until changed.
  if (v.state === 'refused') {
    const why = v.refused_reason ?? 'switchd gave no reason';
    return (
      <span className="pool" data-served="refused">
        <span className="chip badge-dead" title={`switchd refused this service: ${why}`} data-testid={`service-refused-${svc.name}`}>
          refused
        </span>
        <span className="refused-reason" data-testid={`service-refused-reason-${svc.name}`}>{why}</span>
      </span>
    );
  }
  // switchd applies the store's services every 250 ms, so a service just
  // created or moved is not in its /status yet: pending, not a failure.
  if (!v.served) {
    return (
      <span className="chip badge-draining" title={SERVICE_PENDING} data-served="pending" data-testid={`service-pending-${svc.name}`}>
        pending
      </span>
    );
  }
  const down = new Set(v.apps_down);
  const placing = v.placing ? new Set(v.placing) : null;
  return (
    <span className="pool" data-served="true">
      <span className="chip badge-active">served</span>
      {v.members.length === 0 && <span className="muted">no server</span>}
      {placing && placing.size === 0 && v.members.length > 0 && (
        <span className="muted" data-testid={`service-placing-none-${svc.name}`}>none placing</span>
      )}
      {[...v.members].sort((a, b) => a - b).map((id) => {
        const out = placing !== null && !placing.has(id);
        const what = down.has(id) ? 'application down' : servers[id]?.state ?? 'unknown server';
        return (
          <span
            key={id}
            className={`chip badge-${down.has(id) ? 'dead' : servers[id]?.state ?? 'dead'}${out ? ' not-placing' : ''}`}
            title={placing === null ? what : `${what} · ${out ? 'takes no new connections' : 'takes new connections'}`}
            data-placing={placing === null ? undefined : String(!out)}
          >
            {servers[id]?.name ?? `#${id}`}{down.has(id) ? ' (app down)' : ''}
          </span>
        );
      })}
      {v.fail_open && <span className="chip badge-draining" title="every member reports its application down">fail open</span>}
      {v.refusing && (
        <span
          className="chip badge-dead"
          title="no server can take a new connection (every one drained, at weight 0, dead or not serving it): new connections are refused; undrain a server or give one a weight"
          data-testid={`service-refusing-${svc.name}`}
        >
          refusing new connections
        </span>
      )}
    </span>
  );
}
