import { useState } from 'react';
import type { FormEvent } from 'react';
import { Configuration, ServersApi } from '../generated';
import { problemText, toProblem, TOKEN_PATTERN } from '../api';

/** Asks for an API token and checks it with one authenticated request. */
export function Login({ message, onLogin }: { message: string | null; onLogin: (token: string) => void }) {
  const [token, setToken] = useState('');
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);

  const submit = async (e: FormEvent) => {
    e.preventDefault();
    const t = token.trim();
    if (!TOKEN_PATTERN.test(t)) {
      setError('A token is "capy_" followed by 64 lowercase hex digits.');
      return;
    }
    setBusy(true);
    setError(null);
    try {
      await new ServersApi(new Configuration({ basePath: '', accessToken: t })).listServers();
      onLogin(t);
    } catch (err) {
      const p = await toProblem(err);
      setError(p.status === 401 ? 'This token was rejected: unknown or revoked.' : problemText(p));
    } finally {
      setBusy(false);
    }
  };

  return (
    <div className="login">
      <form onSubmit={submit} data-testid="login-form">
        <h1>Capybara</h1>
        <p className="muted">Sign in with an API token.</p>
        {message && (
          <div className="banner warn" data-testid="login-message">
            {message}
          </div>
        )}
        <label htmlFor="token">Bearer token</label>
        <input
          id="token"
          type="password"
          autoComplete="off"
          spellCheck={false}
          placeholder="capy_…"
          value={token}
          onChange={(e) => setToken(e.target.value)}
          data-testid="login-token"
        />
        {error && (
          <div className="field-error" data-testid="login-error">
            {error}
          </div>
        )}
        <button type="submit" disabled={busy} data-testid="login-submit">
          {busy ? 'Checking…' : 'Sign in'}
        </button>
        <p className="muted small">The token is kept in this tab only (sessionStorage).</p>
      </form>
    </div>
  );
}
