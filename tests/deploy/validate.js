#!/usr/bin/env node
// validate.js - checks a YAML stream of Kubernetes objects (what `kubectl kustomize` prints)
// against the Kubernetes API's own schemas, in two passes, and prints one JSON document.
//
//   node validate.js < objects.yaml
//   {"objects": [...], "problems": [{doc, kind, name, pass, path, message}], "opaque": [...],
//    "index": {"interfaces": N, "names": N}}
//   node validate.js --batch < streams.json      (a JSON list of YAML streams: their reports)
//
// Exit status: 0 when there are no problems, 1 when there are, 2 when the tools are broken.
//
// Pass "schema": each object through its kubernetes-models class's validate() (the API's
// OpenAPI schema compiled with ajv by @kubernetes-models/validate): types, enums, formats,
// required fields. Those schemas do not refuse fields they do not know (the API's OpenAPI
// says nothing about extra properties), so a misspelt field passes them, as it would pass
// `kubectl apply` without server-side field validation.
//
// Pass "fields": every mapping of every object is walked against the declared fields of its
// type, read from the same package's type declarations (*.d.ts: one interface per API type,
// one quoted property per field), and a key its type does not declare is a problem naming
// the key, where it is and the type. Free-form maps (labels, annotations, data, resources'
// requests and limits, ...) are declared as maps and their keys are not checked; a mapping
// the walk cannot type (a field declared `any`) is listed in "opaque", so a caller can
// insist that nothing was left unchecked.
'use strict';

const fs = require('fs');
const path = require('path');

function die(msg) {
    process.stderr.write(`validate.js: ${msg}\n`);
    process.exit(2);
}

let YAML;
try {
    YAML = require('yaml');
} catch (e) {
    die(`cannot load the yaml package (run scripts/setup): ${e.message}`);
}

/* ---------- the field index, from the type declarations ---------- */

const PRIMITIVES = new Set(['string', 'number', 'boolean', 'null', 'undefined', 'any',
                            'unknown', 'object']);

// A small reader of the TypeScript the declarations use for types: unions, Array<T>,
// object literals with quoted members and index signatures ({ [key: string]: T }), string
// and number literals, names, and Name["member"].
function tokenize(src, rel) {
    const re = /\s*("(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?|[A-Za-z_$][\w$]*|[{}()<>[\];:?|,=])/y;
    const toks = [];
    let m;
    re.lastIndex = 0;
    while (re.lastIndex < src.length) {
        const at = re.lastIndex;
        if (!(m = re.exec(src))) {
            if (/^\s*$/.test(src.slice(at))) {
                break;
            }
            die(`${rel}: cannot read the declaration near '${src.slice(at, at + 40)}'`);
        }
        toks.push(m[1]);
    }
    return toks;
}

class TypeReader {
    constructor(toks, rel) {
        this.t = toks;
        this.i = 0;
        this.rel = rel;
    }
    peek() {
        return this.t[this.i];
    }
    next() {
        return this.t[this.i++];
    }
    expect(tok) {
        const got = this.next();
        if (got !== tok) {
            die(`${this.rel}: expected '${tok}', found '${got}' in a declaration`);
        }
    }
    type(owner) {
        const parts = [this.primary(owner)];
        while (this.peek() === '|') {
            this.next();
            parts.push(this.primary(owner));
        }
        if (parts.length === 1) {
            return parts[0];
        }
        return parts.every((p) => p.kind === 'scalar') ? {kind: 'scalar', text: 'union'}
                                                        : {kind: 'opaque', text: 'union'};
    }
    primary(owner) {
        const tok = this.next();
        if (tok === '(') {
            const t = this.type(owner);
            this.expect(')');
            return t;
        }
        if (tok === '{') {
            return this.members(owner);
        }
        if (tok === 'Array' && this.peek() === '<') {
            this.next();
            const of = this.type(owner);
            this.expect('>');
            return {kind: 'array', of};
        }
        if (tok.startsWith('"') || /^-?\d/.test(tok) || PRIMITIVES.has(tok)) {
            return tok === 'any' || tok === 'unknown' || tok === 'object'
                       ? {kind: 'opaque', text: tok}
                       : {kind: 'scalar', text: tok};
        }
        if (/^[A-Za-z_$]/.test(tok)) {
            if (this.peek() === '[') { /* IDeployment["kind"]: the literal declared there */
                this.next();
                this.next();
                this.expect(']');
                return {kind: 'scalar', text: tok};
            }
            return {kind: 'ref', name: tok};
        }
        die(`${this.rel}: unexpected '${tok}' in a declared type`);
    }
    // members reads an object type after its '{' up to its '}': named members make an
    // interface, an index signature alone a map.
    members(owner) {
        const props = new Map();
        let index = null;
        while (this.peek() !== '}') {
            const tok = this.next();
            if (tok === '[') {
                this.next(); /* key */
                this.expect(':');
                this.next(); /* string */
                this.expect(']');
                this.expect(':');
                index = this.type(owner);
            } else if (tok.startsWith('"') || /^[A-Za-z_$]/.test(tok)) {
                const name = tok.startsWith('"') ? JSON.parse(tok) : tok;
                if (this.peek() === '?') {
                    this.next();
                }
                this.expect(':');
                props.set(name, this.type(`${owner}.${name}`));
            } else {
                die(`${this.rel}: unexpected '${tok}' among the members of ${owner}`);
            }
            if (this.peek() === ';' || this.peek() === ',') {
                this.next();
            }
        }
        this.expect('}');
        if (index && !props.size) {
            return {kind: 'map', of: index};
        }
        return {kind: 'iface', iface: {name: owner, props}};
    }
}

function listDts(dir, out) {
    for (const e of fs.readdirSync(dir, {withFileTypes: true})) {
        const p = path.join(dir, e.name);
        if (e.isDirectory()) {
            if (e.name !== '_schemas' && e.name !== 'node_modules') {
                listDts(p, out);
            }
        } else if (e.name.endsWith('.d.ts') && e.name !== 'index.d.ts') {
            out.push(p);
        }
    }
    return out;
}

// buildIndex reads every declaration file of the two model packages: interfaces by their
// global name (IIoK8sApiAppsV1DeploymentSpec, and the file-local IDeploymentSpec through the
// file's `export { ... as ... }`), type aliases (Quantity, IntOrString) the same way.
function buildIndex() {
    const roots = ['kubernetes-models', '@kubernetes-models/apimachinery'].map((p) =>
        path.dirname(require.resolve(`${p}/package.json`)));
    const ifaces = new Map(); /* "file#ILocal" -> {name, props: Map(field -> type)} */
    const global = new Map(); /* "IIoK8s..." -> "file#ILocal" */
    const aliases = new Map(); /* "file#ILocal" -> the type of a `declare type` */
    for (const root of roots) {
        for (const file of listDts(root, [])) {
            const src = fs.readFileSync(file, 'utf8').replace(/\/\*[\s\S]*?\*\//g, '');
            const rel = path.relative(root, file);
            let m;
            const ifaceRe = /^export interface (\w+)(?: extends [\w, ]+)? \{/gm;
            while ((m = ifaceRe.exec(src))) {
                const body = src.slice(m.index + m[0].length);
                const r = new TypeReader(tokenize(body.slice(0, body.search(/^\}/m) + 1), rel), rel);
                const t = r.members(m[1]);
                if (t.kind !== 'iface') {
                    die(`${rel}: interface ${m[1]} is not an object type`);
                }
                ifaces.set(`${file}#${m[1]}`, t.iface);
            }
            const typeRe = /^export declare type (\w+) = ([^;]+);$/gm;
            while ((m = typeRe.exec(src))) {
                aliases.set(`${file}#${m[1]}`, new TypeReader(tokenize(m[2], rel), rel).type(m[1]));
            }
            const exportRe = /^export \{ ([^}]+) \};$/gm;
            while ((m = exportRe.exec(src))) {
                for (const pair of m[1].split(',')) {
                    const a = /^\s*(\w+) as (\w+)\s*$/.exec(pair);
                    if (a && a[2].startsWith('II')) {
                        global.set(a[2], `${file}#${a[1]}`);
                    }
                }
            }
        }
    }
    return {ifaces, global, aliases, roots};
}

const INDEX = buildIndex();
if (INDEX.ifaces.size < 500 || INDEX.global.size < 500) {
    die(`the type declarations gave only ${INDEX.ifaces.size} interfaces and ` +
        `${INDEX.global.size} names: has the kubernetes-models layout changed?`);
}

// resolve turns {kind: ref} into the interface or the alias it names.
function resolve(t, depth = 0) {
    if (t.kind !== 'ref') {
        return t;
    }
    const key = INDEX.global.get(t.name);
    if (key && INDEX.ifaces.has(key)) {
        return {kind: 'iface', iface: INDEX.ifaces.get(key)};
    }
    if (key && INDEX.aliases.has(key) && depth < 8) {
        return resolve(INDEX.aliases.get(key), depth + 1);
    }
    return {kind: 'unresolved', text: t.name};
}

// rootType finds the top-level type of an object: kubernetes-models/<apiVersion>/<Kind>.d.ts.
function rootType(apiVersion, kind) {
    if (typeof apiVersion !== 'string' || typeof kind !== 'string' ||
        !/^[\w.-]+(\/[\w.-]+)?$/.test(apiVersion) || !/^\w+$/.test(kind)) {
        return null;
    }
    const file = path.join(INDEX.roots[0], apiVersion, `${kind}.d.ts`);
    return INDEX.ifaces.get(`${file}#I${kind}`) || null;
}

function modelClass(apiVersion, kind) {
    try {
        return require(`kubernetes-models/${apiVersion}/${kind}`)[kind] || null;
    } catch (e) {
        return null;
    }
}

/* ---------- the two passes ---------- */

function isObject(v) {
    return v !== null && typeof v === 'object' && !Array.isArray(v);
}

function showPath(p) {
    return p || '(the object)';
}

// walk checks value against type t; problems and opaque mappings are pushed to out.
function walk(value, t, at, out) {
    t = resolve(t);
    switch (t.kind) {
    case 'iface':
        if (!isObject(value)) {
            return; /* the schema pass reports a wrong type */
        }
        for (const [k, v] of Object.entries(value)) {
            const sub = at ? `${at}.${k}` : k;
            const ft = t.iface.props.get(k);
            if (!ft) {
                const known = [...t.iface.props.keys()].sort().join(', ');
                out.problems.push({pass: 'fields', path: sub,
                                   message: `unknown field "${k}" at ${showPath(at)}: ` +
                                            `${t.iface.name} has only ${known}`});
                continue;
            }
            walk(v, ft, sub, out);
        }
        return;
    case 'array':
        if (Array.isArray(value)) {
            value.forEach((v, i) => walk(v, t.of, `${at}[${i}]`, out));
        }
        return;
    case 'map':
        if (isObject(value)) {
            for (const [k, v] of Object.entries(value)) {
                walk(v, t.of, `${at}[${JSON.stringify(k)}]`, out);
            }
        }
        return;
    case 'scalar':
        return; /* a mapping or list here is a wrong type: the schema pass reports it */
    default: /* opaque or unresolved: nothing to check against */
        if (value !== null && typeof value === 'object') {
            out.opaque.push({path: showPath(at), type: t.text});
        }
    }
}

function schemaPass(obj, cls, out) {
    try {
        new cls(obj).validate();
    } catch (e) {
        const errs = Array.isArray(e.errors) ? e.errors : [];
        if (!errs.length) {
            out.problems.push({pass: 'schema', path: '', message: String(e.message || e)});
        }
        for (const er of errs) {
            const p = (er.instancePath || '').split('/').filter(Boolean)
                          .map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'))
                          .reduce((acc, s) => /^\d+$/.test(s) ? `${acc}[${s}]` : acc ? `${acc}.${s}` : s, '');
            const extra = er.params && Object.keys(er.params).length ? ` ${JSON.stringify(er.params)}` : '';
            out.problems.push({pass: 'schema', path: p,
                               message: `${showPath(p)}: ${er.message || er.keyword}${extra}`});
        }
    }
}

function checkObject(obj) {
    const out = {problems: [], opaque: []};
    if (!isObject(obj)) {
        out.problems.push({pass: 'schema', path: '', message: 'a document that is not a mapping'});
        return out;
    }
    const iface = rootType(obj.apiVersion, obj.kind);
    const cls = iface && modelClass(obj.apiVersion, obj.kind);
    if (!iface || !cls) {
        out.problems.push({pass: 'schema', path: '',
                           message: `no schema for apiVersion "${obj.apiVersion}" kind ` +
                                    `"${obj.kind}" (Kubernetes 1.33 API)`});
        return out;
    }
    schemaPass(obj, cls, out);
    walk(obj, {kind: 'iface', iface}, '', out);
    return out;
}

/* ---------- main ---------- */

// check runs both passes over one YAML stream.
function check(text) {
    const result = {objects: [], problems: [], opaque: [],
                    index: {interfaces: INDEX.ifaces.size, names: INDEX.global.size}};
    const docs = YAML.parseAllDocuments(text, {uniqueKeys: true, strict: true, prettyErrors: true});
    const list = Array.isArray(docs) ? docs : [docs];
    list.forEach((doc, i) => {
        for (const er of [...doc.errors, ...doc.warnings]) {
            result.problems.push({doc: i, pass: 'yaml', path: '', message: er.message});
        }
        if (doc.errors.length) {
            return;
        }
        const obj = doc.toJS({maxAliasCount: 0});
        if (obj === null || obj === undefined) {
            return; /* an empty document */
        }
        const r = checkObject(obj);
        const kind = isObject(obj) ? obj.kind : undefined;
        const name = isObject(obj) && isObject(obj.metadata) ? obj.metadata.name : undefined;
        for (const p of r.problems) {
            result.problems.push({doc: i, kind, name, ...p});
        }
        for (const o of r.opaque) {
            result.opaque.push({doc: i, kind, name, ...o});
        }
        result.objects.push(obj);
    });
    return result;
}

// With --batch, stdin is a JSON list of YAML streams and stdout the list of their reports
// (one process for many checks; the exit status is then 0). The status is set, not exited
// with, so that all of a large report reaches a pipe.
function main(input) {
    if (process.argv.includes('--batch')) {
        process.stdout.write(JSON.stringify(JSON.parse(input).map(check)) + '\n');
        return;
    }
    const result = check(input);
    process.stdout.write(JSON.stringify(result) + '\n');
    process.exitCode = result.problems.length ? 1 : 0;
}

// stdin is read as a stream: fs.readFileSync(0) fails with EAGAIN where the pipe is
// non-blocking and its writer has not written yet (seen with Node.js 18)
const chunks = [];
process.stdin.on('data', (c) => chunks.push(c));
process.stdin.on('end', () => main(Buffer.concat(chunks).toString('utf8')));
