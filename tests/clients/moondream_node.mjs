// Drives the published `moondream` Node client (npm 0.2.0) for tests/test_clients.py.
//
//   node moondream_node.mjs INSTALL_DIR < plan.json
//
// INSTALL_DIR: the folder npm installed tests/clients/package.json into.  The plan:
//   {"endpoint": "http://.../v1", "apiKey": "..." or null, "image": "file path",
//    "calls": [{"method": "caption", "request": {...}}, ...]}
// A request's `"image": true` stands for the image file's Buffer, which the client encodes
// itself (sharp, to JPEG), as a user's call would.  Prints one JSON object:
//   {"imageUrl": the data URI the client makes of the image,
//    "results": [{"ok": true, "value": {...}} or {"ok": false, "error": "..."}, ...]}
// where a streamed field (an async generator) is collected into the list of its chunks.
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const require = createRequire(path.join(path.resolve(process.argv[2]), 'package.json'));
const { vl } = require('moondream');

const plan = JSON.parse(fs.readFileSync(0, 'utf8'));
const image = fs.readFileSync(plan.image);
const model = new vl({ apiKey: plan.apiKey ?? undefined, endpoint: plan.endpoint });

async function settle(v) {
  if (v && typeof v[Symbol.asyncIterator] === 'function') {
    const chunks = [];
    for await (const c of v) chunks.push(c);
    return chunks;
  }
  return v;
}

const results = [];
for (const call of plan.calls) {
  const request = { ...call.request };
  if (request.image === true) request.image = image;
  try {
    const out = await model[call.method](request);
    const value = {};
    for (const [k, v] of Object.entries(out)) value[k] = await settle(v);
    results.push({ ok: true, value });
  } catch (e) {
    results.push({ ok: false, error: String(e && e.message ? e.message : e) });
  }
}
const { imageUrl } = await model.encodeImage(image);
process.stdout.write(JSON.stringify({ imageUrl, results }));
