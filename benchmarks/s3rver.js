// Runs s3rver (the npm package, unmodified) for the benchmark, optionally answering every
// request only after --delay-ms: the shaped-link mode's stand-in for S3's time to first byte,
// because this kernel has no netem.
'use strict';

const http = require('http');
const S3rver = require('s3rver');

function option(name, fallback) {
  const at = process.argv.indexOf(`--${name}`);
  return at === -1 ? fallback : process.argv[at + 1];
}

const address = option('address', '127.0.0.1');
const port = Number(option('port', '0'));
const directory = option('directory');
const delayMs = Number(option('delay-ms', '0'));
if (!directory) {
  console.error('usage: node s3rver.js --directory DIR [--address A] [--port P] [--delay-ms MS]');
  process.exit(2);
}

const app = new S3rver({ directory, silent: true });
const handle = app.callback();
const server = http.createServer(
  delayMs > 0 ? (req, res) => setTimeout(handle, delayMs, req, res) : handle,
);
// Clients keep connections open between runs; never let node close them under a client.
server.keepAliveTimeout = 120000;
server.headersTimeout = 125000;
server.listen(port, address, () => {
  const bound = server.address();
  console.log(`listening ${bound.address}:${bound.port}`);
});
process.on('SIGTERM', () => server.close(() => process.exit(0)));
