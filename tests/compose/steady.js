// k6 load for tests/compose/run.sh: VUS virtual users on keep-alive
// connections to the service address, for DURATION. Any failed request or
// non-200 answer fails the thresholds (k6 exits 99).
import http from 'k6/http';
import { check, sleep } from 'k6';

const VIP = __ENV.VIP || '172.28.100.1';

export const options = {
  scenarios: {
    steady: {
      executor: 'constant-vus',
      vus: Number(__ENV.VUS || 20),
      duration: __ENV.DURATION || '30s',
    },
  },
  thresholds: {
    http_req_failed: ['rate==0'],
    checks: ['rate==1'],
  },
  summaryTrendStats: ['avg', 'p(99)', 'max'],
};

export default function () {
  // A long timeout: a request in flight during a switch takeover is
  // delayed by TCP retransmission, not lost; the test counts failures.
  const r = http.get(`http://${VIP}/`, { timeout: '30s' });
  check(r, { 'status is 200': (x) => x.status === 200 });
  sleep(0.05);
}
