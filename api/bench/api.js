// k6 load of the API: 500 req/s of mixed reads with occasional writes for
// 30 s, plus 50 open SSE streams. Run by api/scripts/bench.sh, which starts
// the server and passes API_URL and API_TOKEN.
import http from 'k6/http';
import { check } from 'k6';

const URL = __ENV.API_URL;
const AUTH = { headers: { Authorization: `Bearer ${__ENV.API_TOKEN}`, 'Content-Type': 'application/json' } };
const DURATION = __ENV.DURATION || '30s';

export const options = {
  scenarios: {
    mixed: {
      executor: 'constant-arrival-rate',
      rate: Number(__ENV.RATE || 500),
      timeUnit: '1s',
      duration: DURATION,
      preAllocatedVUs: 50,
      maxVUs: 200,
      exec: 'mixed',
    },
    sse: {
      executor: 'constant-vus',
      vus: Number(__ENV.SSE_CLIENTS || 50),
      duration: DURATION,
      exec: 'sse',
    },
  },
  // Declared so that the summary carries the mixed scenario's own numbers.
  thresholds: {
    'http_req_duration{scenario:mixed}': ['p(99)<1000000'],
    'http_req_failed{scenario:mixed}': ['rate<=1'],
    'http_reqs{scenario:mixed}': ['count>=0'],
  },
  summaryTrendStats: ['avg', 'p(50)', 'p(95)', 'p(99)', 'max'],
};

const READS = ['/v1/servers', '/v1/servers/1', '/v1/services', '/v1/policy', '/v1/connections?limit=100',
               '/v1/migrations', '/v1/audit?limit=50', '/v1/servers/3/drain'];

export function mixed() {
  const r = Math.random();
  let res;
  if (r < 0.05) {
    // occasional writes: weight changes and policy tweaks (audited)
    if (r < 0.025) {
      res = http.put(`${URL}/v1/servers/2/weight`, JSON.stringify({ weight: 50 + Math.floor(Math.random() * 100) }), Object.assign({ tags: { kind: 'write' } }, AUTH));
    } else {
      res = http.patch(`${URL}/v1/policy`, JSON.stringify({ connection_cooldown_ms: 500 + Math.floor(Math.random() * 1000) }), Object.assign({ tags: { kind: 'write' } }, AUTH));
    }
  } else {
    const path = READS[Math.floor(Math.random() * READS.length)];
    res = http.get(`${URL}${path}`, Object.assign({ tags: { kind: 'read', name: path } }, AUTH));
  }
  check(res, { 'status < 400': (x) => x.status > 0 && x.status < 400 });
}

// One long-lived SSE stream per VU, held for the whole run (k6 reads the
// body until the request timeout closes it; only the connection matters).
export function sse() {
  const res = http.get(`${URL}/v1/events?types=load,policy,server`, {
    headers: { Authorization: `Bearer ${__ENV.API_TOKEN}`, Accept: 'text/event-stream' },
    timeout: DURATION,
    tags: { kind: 'sse' },
    responseCallback: http.expectedStatuses(200, 0),
  });
  check(res, { 'sse open': (x) => x.status === 200 || x.status === 0 || x.error_code === 1050 });
}

export function handleSummary(data) {
  return { [__ENV.SUMMARY || 'k6-summary.json']: JSON.stringify(data), stdout: '' };
}
