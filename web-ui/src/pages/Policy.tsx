import { useEffect, useMemo, useRef, useState } from 'react';
import type { FormEvent } from 'react';
import type { Policy, PolicyPatch } from '../generated';
import { POLICY_SCHEMA } from '../generated/policySchema';
import type { PolicyFieldSchema } from '../generated/policySchema';
import type { PageProps } from '../App';
import { allows, problemText, toProblem } from '../api';

type Form = Record<string, string | boolean>;
type Errors = Record<string, string>;

const UNITS: Record<string, string> = { _pct: '%', _ms: 'ms', _us: 'µs', _threshold: 'packets' };

function label(name: string): string {
  const s = name.replace(/_(pct|ms|us)$/, '').replace(/_/g, ' ');
  return s.charAt(0).toUpperCase() + s.slice(1);
}

function unit(name: string): string {
  for (const [suffix, u] of Object.entries(UNITS)) if (name.endsWith(suffix)) return u;
  if (name === 'max_migrations_per_sec_per_server') return '/s';
  return '';
}

/** The allowed range, as the spec states it. */
function range(fs: PolicyFieldSchema): string {
  if (fs.minimum === undefined && fs.maximum === undefined) return '';
  const lo = fs.minimum === undefined ? '' : `${fs.minimum} ${fs.exclusiveMinimum ? '<' : '≤'} `;
  const hi = fs.maximum === undefined ? '' : ` ${fs.exclusiveMaximum ? '<' : '≤'} ${fs.maximum}`;
  return `${lo}x${hi}`;
}

function toForm(p: Policy): Form {
  const f: Form = {};
  for (const fs of POLICY_SCHEMA.fields) {
    const v = (p as any)[fs.name];
    f[fs.name] = fs.type === 'boolean' ? Boolean(v) : v === undefined || v === null ? '' : String(v);
  }
  return f;
}

/** Checks one field against its schema: the same constraints the spec states. */
function checkField(fs: PolicyFieldSchema, raw: string | boolean): string | null {
  if (fs.type === 'boolean') return null;
  const s = String(raw).trim();
  if (fs.enum) return fs.enum.includes(s) ? null : `one of ${fs.enum.join(', ')}`;
  if (s === '') return 'required';
  if (fs.type === 'integer' && !/^-?\d+$/.test(s)) return 'a whole number';
  if (fs.type === 'number' && !/^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(s)) return 'a number';
  const n = Number(s);
  if (fs.minimum !== undefined) {
    if (fs.exclusiveMinimum ? n <= fs.minimum : n < fs.minimum)
      return `must be ${fs.exclusiveMinimum ? 'above' : 'at least'} ${fs.minimum}`;
  }
  if (fs.maximum !== undefined) {
    if (fs.exclusiveMaximum ? n >= fs.maximum : n > fs.maximum)
      return `must be ${fs.exclusiveMaximum ? 'below' : 'at most'} ${fs.maximum}`;
  }
  return null;
}

/** The spec's cross-field rules (stated in the Policy schema's description). */
function checkCross(f: Form, errors: Errors): void {
  const hyst = Number(f.hysteresis_pct);
  const thr = Number(f.proactive_threshold_pct);
  if (!errors.hysteresis_pct && !errors.proactive_threshold_pct && !(hyst < thr))
    errors.hysteresis_pct = 'must be below the proactive threshold';
  const hb = Number(f.heartbeat_interval_ms);
  const dead = Number(f.dead_after_ms);
  if (!errors.dead_after_ms && !errors.heartbeat_interval_ms && !(dead >= 2 * hb))
    errors.dead_after_ms = 'must be at least twice the heartbeat interval';
}

function validate(f: Form): Errors {
  const errors: Errors = {};
  for (const fs of POLICY_SCHEMA.fields) {
    const e = checkField(fs, f[fs.name]);
    if (e) errors[fs.name] = e;
  }
  checkCross(f, errors);
  return errors;
}

function parse(fs: PolicyFieldSchema, raw: string | boolean): unknown {
  if (fs.type === 'boolean') return raw;
  if (fs.type === 'integer' || fs.type === 'number') return Number(raw);
  return raw;
}

/** The spec's `field` is a dotted path; the policy's fields are top-level. */
function fieldOfProblem(field: string | undefined): string | null {
  if (!field) return null;
  const top = field.replace(/^\//, '').split(/[./[]/)[0];
  return POLICY_SCHEMA.fields.some((f) => f.name === top) ? top : null;
}

/** Every migration and placement tunable, validated like the spec says. */
export function PolicyPage({ state, clients, dispatch, role }: PageProps) {
  const operate = allows(role, 'operator');
  const policy = state.policy;
  const [form, setForm] = useState<Form | null>(policy ? toForm(policy) : null);
  const [dirty, setDirty] = useState<Set<string>>(new Set());
  const [serverErrors, setServerErrors] = useState<Errors>({});
  const [status, setStatus] = useState<{ kind: 'ok' | 'error' | 'info'; text: string } | null>(null);
  const [busy, setBusy] = useState(false);
  const [submitted, setSubmitted] = useState(false);
  const dirtyRef = useRef(dirty);
  dirtyRef.current = dirty;

  // A policy from the server (listing, save, or another operator's change via
  // the `policy` event) replaces every field the operator has not edited.
  useEffect(() => {
    if (!policy) return;
    setForm((old) => {
      const fresh = toForm(policy);
      if (!old) return fresh;
      const merged: Form = { ...fresh };
      for (const k of dirtyRef.current) merged[k] = old[k];
      if (dirtyRef.current.size > 0 && JSON.stringify(merged) !== JSON.stringify(old))
        setStatus({ kind: 'info', text: 'The policy changed on the server; fields you have not edited were updated.' });
      return merged;
    });
  }, [policy, state.policySeq]);

  const clientErrors = useMemo(() => (form ? validate(form) : {}), [form]);

  if (!form || !policy) return <p className="muted">Loading the policy…</p>;

  const set = (name: string, v: string | boolean) => {
    setForm({ ...form, [name]: v });
    const d = new Set(dirty);
    const orig = toForm(policy)[name];
    if (String(orig) === String(v)) d.delete(name);
    else d.add(name);
    setDirty(d);
    if (serverErrors[name]) {
      const se = { ...serverErrors };
      delete se[name];
      setServerErrors(se);
    }
    setStatus(null);
  };

  const save = async (e: FormEvent) => {
    e.preventDefault();
    setSubmitted(true);
    if (Object.keys(clientErrors).length > 0) {
      setStatus({ kind: 'error', text: 'Fix the marked fields first.' });
      return;
    }
    const patch: Record<string, unknown> = {};
    for (const fs of POLICY_SCHEMA.fields) if (dirty.has(fs.name)) patch[fs.name] = parse(fs, form[fs.name]);
    if (Object.keys(patch).length === 0) {
      setStatus({ kind: 'info', text: 'Nothing changed.' });
      return;
    }
    setBusy(true);
    setServerErrors({});
    try {
      const saved = await clients.policy.patchPolicy({ policyPatch: patch as PolicyPatch });
      setDirty(new Set());
      setForm(toForm(saved));
      dispatch({ type: 'policy', policy: saved });
      setStatus({ kind: 'ok', text: `Saved ${Object.keys(patch).join(', ')}.` });
    } catch (err) {
      const p = await toProblem(err);
      const f = fieldOfProblem(p.field);
      if (f) setServerErrors({ [f]: p.detail || p.title });
      setStatus({ kind: 'error', text: problemText(p) });
    } finally {
      setBusy(false);
    }
  };

  const reset = () => {
    setForm(toForm(policy));
    setDirty(new Set());
    setServerErrors({});
    setSubmitted(false);
    setStatus(null);
  };

  return (
    <form className="panel policy" onSubmit={save} noValidate data-testid="policy-form">
      <h2>Policy</h2>
      <p className="muted small">
        Every migration and placement tunable. Changes apply at once to the switch and the host agents; only the
        fields you edit are sent (PATCH /v1/policy).
      </p>
      <div className="policy-grid">
        {POLICY_SCHEMA.fields.map((fs) => {
          // Client-side errors show once a field is edited (or on save); the server's
          // 422 `field` error shows until the field is edited again.
          const err = serverErrors[fs.name] ?? (dirty.has(fs.name) || submitted ? clientErrors[fs.name] : undefined);
          const id = `policy-${fs.name}`;
          return (
            <div className={`field ${dirty.has(fs.name) ? 'dirty' : ''}`} key={fs.name}>
              <label htmlFor={id} title={fs.description}>
                {label(fs.name)}
                {unit(fs.name) && <span className="muted small"> ({unit(fs.name)})</span>}
              </label>
              {fs.type === 'boolean' ? (
                <input
                  id={id}
                  type="checkbox"
                  checked={form[fs.name] as boolean}
                  onChange={(e) => set(fs.name, e.target.checked)}
                  data-testid={`policy-field-${fs.name}`}
                />
              ) : fs.enum ? (
                <select
                  id={id}
                  value={form[fs.name] as string}
                  onChange={(e) => set(fs.name, e.target.value)}
                  data-testid={`policy-field-${fs.name}`}
                >
                  {fs.enum.map((v) => (
                    <option key={v} value={v}>
                      {v}
                    </option>
                  ))}
                </select>
              ) : (
                <input
                  id={id}
                  inputMode={fs.type === 'integer' ? 'numeric' : 'decimal'}
                  value={form[fs.name] as string}
                  onChange={(e) => set(fs.name, e.target.value)}
                  aria-invalid={err ? true : undefined}
                  data-testid={`policy-field-${fs.name}`}
                />
              )}
              <div className="hint small muted">
                {range(fs)}
                {range(fs) && fs.description ? ' · ' : ''}
                {fs.description}
              </div>
              {err && (
                <div className="field-error" data-testid={`policy-error-${fs.name}`}>
                  {err}
                </div>
              )}
            </div>
          );
        })}
      </div>
      <div className="actions">
        <button type="submit" disabled={busy || !operate} title={operate ? undefined : 'Needs an operator token'} data-testid="policy-save">
          {busy ? 'Saving…' : `Save${dirty.size ? ` (${dirty.size})` : ''}`}
        </button>
        <button type="button" className="link" onClick={reset} disabled={busy || dirty.size === 0} data-testid="policy-reset">
          Discard changes
        </button>
        {status && (
          <span className={`status status-${status.kind}`} data-testid="policy-status" data-kind={status.kind}>
            {status.text}
          </span>
        )}
      </div>
    </form>
  );
}
