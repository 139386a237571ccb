// Node.js 18 (Debian 12's) has no global `crypto`, which the MCP server uses for its session
// ids; newer Node.js has it. Loaded with `node --require` before the server.
if (typeof globalThis.crypto === "undefined") {
  globalThis.crypto = require("node:crypto").webcrypto;
}
