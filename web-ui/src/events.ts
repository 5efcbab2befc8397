// Follows `GET /v1/events` (server-sent events) and reconnects after errors.
import { useEffect, useRef } from 'react';
import {
  DrainFromJSON,
  LoadEventFromJSON,
  MigrationFromJSON,
  PolicyFromJSON,
  ServerFromJSON,
  ServiceFromJSON,
} from './generated';
import { eventsUrl } from './api';
import type { Action } from './state';

const RETRY_MIN_MS = 500;
const RETRY_MAX_MS = 10_000;

export interface StreamCallbacks {
  dispatch: (a: Action) => void;
  /** The stream (re)opened or lost events: re-list everything. */
  resync: () => void;
  /** The stream failed; check whether the token is still valid. */
  probe: () => void;
}

/**
 * Opens the event stream with the token in `?access_token=` (EventSource
 * cannot send headers) and keeps it open: on any error it closes the
 * EventSource and reconnects with exponential backoff. Every (re)open
 * triggers `resync`, so nothing missed while disconnected stays missing.
 */
export function useEventStream(token: string, cb: StreamCallbacks): void {
  const cbRef = useRef(cb);
  cbRef.current = cb;

  useEffect(() => {
    let es: EventSource | null = null;
    let timer: number | undefined;
    let attempt = 0;
    let stopped = false;

    const on = (name: string, handle: (data: unknown) => void) => {
      es!.addEventListener(name, (e: Event) => {
        let data: unknown;
        try {
          data = JSON.parse((e as MessageEvent).data);
        } catch {
          console.warn(`event ${name}: data is not JSON`);
          return;
        }
        cbRef.current.dispatch({ type: 'event' });
        handle(data);
      });
    };

    const connect = () => {
      if (stopped) return;
      cbRef.current.dispatch({ type: 'stream', status: attempt === 0 ? 'connecting' : 'reconnecting' });
      es = new EventSource(eventsUrl(token));
      es.onopen = () => {
        attempt = 0;
        cbRef.current.dispatch({ type: 'stream', status: 'live' });
        cbRef.current.resync();
      };
      es.onerror = () => {
        es?.close();
        es = null;
        if (stopped) return;
        cbRef.current.dispatch({ type: 'stream', status: 'reconnecting' });
        cbRef.current.probe();
        const delay = Math.min(RETRY_MAX_MS, RETRY_MIN_MS * 2 ** attempt);
        attempt += 1;
        timer = window.setTimeout(connect, delay);
      };
      const d = (a: Action) => cbRef.current.dispatch(a);
      on('load', (x) => d({ type: 'load', event: LoadEventFromJSON(x) }));
      on('server', (x: any) => d({ type: 'server', id: x.id, server: x.server ? ServerFromJSON(x.server) : null }));
      on('service', (x: any) => d({ type: 'service', name: x.name, service: x.service ? ServiceFromJSON(x.service) : null }));
      on('drain', (x) => d({ type: 'drain', drain: DrainFromJSON(x) }));
      on('migration', (x) => d({ type: 'migration', migration: MigrationFromJSON(x) }));
      on('policy', (x) => d({ type: 'policy', policy: PolicyFromJSON(x) }));
      on('lagged', () => cbRef.current.resync());
    };

    connect();
    return () => {
      stopped = true;
      es?.close();
      if (timer !== undefined) window.clearTimeout(timer);
    };
  }, [token]);
}
