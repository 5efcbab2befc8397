// The dashboard's only way to the REST API: the client generated from
// api/openapi.yaml (src/generated), configured with the operator's token.
import {
  Configuration,
  MigrationsApi,
  PolicyApi,
  ResponseError,
  ServersApi,
  ServicesApi,
  TokensApi,
  FetchError,
  Middleware,
} from './generated';

const TOKEN_KEY = 'capybara.token';
const LOGOUT_REASON_KEY = 'capybara.logoutReason';

/** The shape the spec says every error has (RFC 9457 problem details). */
export interface Problem {
  type?: string;
  title: string;
  status: number;
  detail?: string;
  field?: string;
}

export function storedToken(): string | null {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function storeToken(token: string): void {
  sessionStorage.setItem(TOKEN_KEY, token);
}

/** Forgets the token; `reason` is shown on the login page. */
export function clearToken(reason?: string): void {
  sessionStorage.removeItem(TOKEN_KEY);
  if (reason) sessionStorage.setItem(LOGOUT_REASON_KEY, reason);
}

export function takeLogoutReason(): string | null {
  const r = sessionStorage.getItem(LOGOUT_REASON_KEY);
  sessionStorage.removeItem(LOGOUT_REASON_KEY);
  return r;
}

/** Spec: `capy_` followed by 64 hex digits. */
export const TOKEN_PATTERN = /^capy_[0-9a-f]{64}$/;

export interface Clients {
  servers: ServersApi;
  services: ServicesApi;
  policy: PolicyApi;
  migrations: MigrationsApi;
  tokens: TokensApi;
}

/** What a role may do (api/openapi.yaml: viewer < operator < admin). */
export type Role = 'viewer' | 'operator' | 'admin';
const RANK: Record<Role, number> = { viewer: 0, operator: 1, admin: 2 };
/** `role` may perform operations that need `min`; unknown (still loading) may not. */
export function allows(role: Role | null, min: Role): boolean {
  return role !== null && RANK[role] >= RANK[min];
}

/**
 * Clients that send `token`; any 401 calls `onUnauthorized` (the app then
 * returns to the login page with a message).
 */
export function makeClients(token: string, onUnauthorized: (message: string) => void): Clients {
  const on401: Middleware = {
    post: async ({ response }) => {
      if (response.status === 401) {
        const p = await readProblem(response.clone());
        onUnauthorized(p?.detail || p?.title || 'The token was rejected (401).');
      }
      return response;
    },
  };
  const config = new Configuration({ basePath: '', accessToken: token, middleware: [on401] });
  return {
    servers: new ServersApi(config),
    services: new ServicesApi(config),
    policy: new PolicyApi(config),
    migrations: new MigrationsApi(config),
    tokens: new TokensApi(config),
  };
}

async function readProblem(response: Response): Promise<Problem | null> {
  try {
    const body = await response.json();
    if (body && typeof body === 'object' && typeof body.title === 'string') return body as Problem;
  } catch {
    // Not JSON: fall through.
  }
  return null;
}

/** Turns anything a generated call throws into a problem to show. */
export async function toProblem(err: unknown): Promise<Problem> {
  if (err instanceof ResponseError) {
    const p = await readProblem(err.response.clone());
    if (p) return p;
    return { title: err.response.statusText || 'Request failed', status: err.response.status };
  }
  if (err instanceof FetchError) {
    return { title: 'The API is unreachable', status: 0, detail: String(err.cause?.message ?? err.message) };
  }
  return { title: 'Unexpected error', status: 0, detail: String(err) };
}

export function problemText(p: Problem): string {
  const head = p.status ? `${p.status} ${p.title}` : p.title;
  return p.detail ? `${head}: ${p.detail}` : head;
}

/** URL of the event stream; EventSource cannot set headers, so the spec accepts `?access_token=`. */
export function eventsUrl(token: string): string {
  return `/v1/events?access_token=${encodeURIComponent(token)}`;
}
