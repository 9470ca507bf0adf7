"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const state = { models: [], answer: null, task: null, image: null, imageURL: null, imageEl: null,
                  view: "attention" };
  // Other views (lens.js) register here: { submit(), show(on), accepts(task) }.
  const views = {};
  const DEFAULT_MODULE = { "text-generation": "decoder.self", "translation": "decoder.cross",
                           "image-classification": "encoder.self" };

  // ------------------------------------------------------------------ helpers
  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;", "'": "&#39;" })[c]);
  }
  function shown(tok) {  // make whitespace visible in a token label
    return String(tok).replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  }
  const measureCtx = document.createElement("canvas").getContext("2d");
  function textWidth(s, font) { measureCtx.font = font; return measureCtx.measureText(s).width; }

  // Light-to-dark blue ramp: faint weights stay close to the background, strong ones stand out.
  const RAMP = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
  function colour(v) {
    v = Math.max(0, Math.min(1, v)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(v)), f = v - i, a = RAMP[i], b = RAMP[i + 1];
    return "rgb(" + [0, 1, 2].map((c) => Math.round(a[c] + (b[c] - a[c]) * f)).join(",") + ")";
  }
  function fmt(w) { return w >= 0.001 || w === 0 ? w.toFixed(4) : w.toExponential(2); }

  function showError(message) { const e = $("error"); e.textContent = message; e.classList.remove("hidden"); }
  function clearError() { const e = $("error"); e.textContent = ""; e.classList.add("hidden"); }
  function status(message) { $("status").textContent = message || ""; }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const key = $("api-key").value.trim();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // Paths are relative to the page, so the viewer also works behind a path prefix.
  async function api(path, body) {
    let resp;
    try {
      resp = await fetch(path, body === undefined ? { headers: headers(false) }
                                                  : { method: "POST", headers: headers(true), body: JSON.stringify(body) });
    } catch (err) {
      throw new Error("could not reach the server: " + err.message);
    }
    let data = null;
    try { data = await resp.json(); } catch (err) { data = null; }
    if (!resp.ok) {
      const msg = data && data.error && data.error.message ? data.error.message : "HTTP " + resp.status + " " + resp.statusText;
      const e = new Error(msg + " (HTTP " + resp.status + ")");
      e.status = resp.status;
      throw e;
    }
    if (data === null) throw new Error("the server's answer is not JSON");
    return data;
  }

  function parseLayers(text) {
    text = text.trim();
    if (!text) return null;
    const out = [];
    for (const part of text.split(/[\s,]+/).filter(Boolean)) {
      const m = /^(\d+)(?:-(\d+))?$/.exec(part);
      if (!m) throw new Error("layers to fetch: '" + part + "' is not a number or a range such as 2-3");
      const a = +m[1], b = m[2] === undefined ? a : +m[2];
      for (let i = Math.min(a, b); i <= Math.max(a, b); i++) out.push(i);
    }
    return out;
  }

  // ------------------------------------------------------------------ tooltip
  const tip = $("tooltip");
  function showTip(text, ev) {
    tip.textContent = text;
    tip.classList.remove("hidden");
    const pad = 14, r = tip.getBoundingClientRect();
    let x = ev.clientX + pad, y = ev.clientY + pad;
    if (x + r.width > window.innerWidth) x = ev.clientX - r.width - pad;
    if (y + r.height > window.innerHeight) y = ev.clientY - r.height - pad;
    tip.style.left = Math.max(0, x) + "px";
    tip.style.top = Math.max(0, y) + "px";
  }
  function hideTip() { tip.classList.add("hidden"); }

  // ------------------------------------------------------------------ models
  async function loadModels(attempt) {
    attempt = attempt || 0;
    let list;
    try {
      list = (await api("v1/models")).data || [];
    } catch (err) {
      showError("could not list the models: " + err.message);
      $("model").innerHTML = "<option value=\"\">(no models)</option>";
      return;
    }
    if (!list.length && attempt < 20) {  // models still loading
      status("waiting for the server to load its models…");
      setTimeout(() => loadModels(attempt + 1), 3000);
      return;
    }
    status("");
    state.models = list;
    const sel = $("model"), previous = sel.value;
    sel.innerHTML = list.map((m) => "<option value=\"" + esc(m.id) + "\" data-task=\"" + esc(m.task || "") + "\">" +
                                    esc(m.id) + " — " + esc(m.task || "?") + "</option>").join("");
    if (!list.length) {
      sel.innerHTML = "<option value=\"\">(no models)</option>";
      showError("the server serves no models");
    } else if (list.some((m) => m.id === previous)) {
      sel.value = previous;
    }
    onModelChange();
  }

  function currentTask() {
    const opt = $("model").selectedOptions[0];
    return opt ? opt.dataset.task || null : null;
  }

  function onModelChange() {
    const view = views[state.view], sel = $("model");
    for (const opt of sel.options) {  // e.g. a ViT has no logit lens
      opt.disabled = !!(view && view.accepts) && !view.accepts(opt.dataset.task || null);
    }
    if (sel.selectedOptions[0] && sel.selectedOptions[0].disabled) {
      const ok = [...sel.options].find((o) => !o.disabled);
      if (ok) sel.value = ok.value;
    }
    const task = currentTask();
    document.body.dataset.task = task || "";
    $("text-row").classList.toggle("hidden", task === "image-classification");
    $("target-row").classList.toggle("hidden", task !== "translation" || state.view === "document");
    $("image-row").classList.toggle("hidden", task !== "image-classification");
    $("input-hint").textContent = state.view === "document" ? "(a text or an HTML page)"
      : task === "translation" ? "(the source sentence)" : "(the language model's input)";
  }

  $("image").addEventListener("change", () => {
    const file = $("image").files[0];
    state.image = null; state.imageURL = null; state.imageEl = null;
    $("image").dataset.ready = "false";
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      const url = String(reader.result);
      state.imageURL = url;
      state.image = url.slice(url.indexOf(",") + 1);  // base64 without the data: prefix
      const img = new Image();
      img.onload = () => {
        state.imageEl = img;
        $("image").dataset.ready = "true";
        if (state.answer && state.task === "image-classification") render();
      };
      img.onerror = () => showError("the browser cannot show this file as an image; the server may still read it");
      img.src = url;
    };
    reader.onerror = () => showError("could not read the file: " + (reader.error && reader.error.message));
    reader.readAsDataURL(file);
  });

  // ------------------------------------------------------------------ request
  async function submit(ev) {
    ev.preventDefault();
    clearError();
    if (state.view !== "attention") { await views[state.view].submit(); return; }
    const model = $("model").value, task = currentTask();
    if (!model) { showError("pick a model first"); return; }
    const body = { model: model, format: "json" };
    try {
      const layers = parseLayers($("fetch-layers").value);
      if (layers) body.layers = layers;
    } catch (err) { showError(err.message); return; }
    if (task === "image-classification") {
      if (!state.image) { showError("choose an image file first"); return; }
      body.image = state.image;
    } else {
      body.input = $("input").value;
      if (!body.input.trim()) { showError("type some text first"); return; }
      const target = $("target").value;
      if (task === "translation" && target.trim()) body.target = target;
    }
    for (const id of ["heatmap", "alignment", "vit"]) $(id).dataset.rendered = "false";
    $("submit").disabled = true;
    status("computing the attention maps…");
    const t0 = performance.now();
    try {
      const answer = await api("v1/attention", body);
      if (!answer.maps || !answer.maps.length) throw new Error("the answer holds no attention maps");
      state.answer = answer;
      state.task = task;
      status("model " + answer.model + ": " + answer.maps.length + " maps in " +
             Math.round(performance.now() - t0) + " ms");
      fillSelection();
      render();
    } catch (err) {
      status("");
      showError(err.message);
    } finally {
      $("submit").disabled = false;
    }
  }

  // ------------------------------------------------------------------ selection
  function mapsOf(module) { return state.answer.maps.filter((m) => m.module === module); }

  function fillSelection() {
    const a = state.answer, modules = [];
    for (const m of a.maps) if (!modules.includes(m.module)) modules.push(m.module);
    const modSel = $("module");
    modSel.innerHTML = modules.map((m) => "<option>" + esc(m) + "</option>").join("");
    const preferred = DEFAULT_MODULE[state.task];
    modSel.value = modules.includes(preferred) ? preferred : modules[0];
    $("head").replaceChildren();  // a new answer starts on head 0
    fillLayers();
    for (const id of ["module", "layer", "head"]) $(id).disabled = false;
    const used = $("target-used");
    if (state.task === "translation" && typeof a.target === "string") {
      used.innerHTML = "target: <b></b>";
      used.querySelector("b").textContent = a.target || "(empty)";
      used.classList.remove("hidden");
    } else {
      used.classList.add("hidden");
    }
  }

  function fillLayers() {
    const layerSel = $("layer"), before = layerSel.value;
    const layers = mapsOf($("module").value).map((m) => m.layer);
    layerSel.innerHTML = layers.map((l) => "<option value=\"" + l + "\">" + l + "</option>").join("");
    layerSel.value = layers.map(String).includes(before) ? before : String(layers[layers.length - 1]);
    fillHeads();
  }

  function shownMap() { return mapsOf($("module").value).find((m) => m.layer === +$("layer").value); }

  // The heads of the map shown: modules and layers may have different numbers of heads (a translator's encoder
  // and decoder), so the choice is offered per map and kept where the next map has that head too.
  function fillHeads() {
    const headSel = $("head"), before = headSel.value, map = shownMap();
    const count = map ? map.weights.length : 0;
    let opts = "";
    for (let h = 0; h < count; h++) opts += "<option value=\"" + h + "\">" + h + "</option>";
    headSel.innerHTML = opts + "<option value=\"mean\">mean of heads</option>";
    headSel.value = before === "mean" || (before !== "" && +before < count) ? before : "0";
  }

  // `head` of `map`, or the mean of its heads where it has no such head (the alignment beside another module).
  function headOf(map, head) { return head === "mean" || +head < map.weights.length ? head : "mean"; }
  function headName(head) { return head === "mean" ? "mean of heads" : "head " + head; }

  // The (query x key) weights of one head, or their mean over the heads.
  function headWeights(map, head) {
    if (head !== "mean") return map.weights[+head];
    const H = map.weights.length;
    return map.weights[0].map((row, q) => row.map((_, k) => {
      let s = 0;
      for (let h = 0; h < H; h++) s += map.weights[h][q][k];
      return s / H;
    }));
  }
  function maxOf(W) { let m = 0; for (const row of W) for (const w of row) if (w > m) m = w; return m || 1; }
  // What each row's weights are divided by before they are coloured, as chosen in #scale.
  function norms(W) {
    const mode = $("scale").value;
    if (mode === "row") return W.map((row) => row.reduce((a, b) => Math.max(a, b), 0) || 1);
    const m = mode === "map" ? maxOf(W) : 1;
    return W.map(() => m);
  }
  function scaleLabel(n) {
    const mode = $("scale").value;
    return mode === "row" ? "the row's largest" : mode === "map" ? fmt(n[0]) : "1";
  }

  function render() {
    if (!state.answer) return;
    hideTip();
    const module = $("module").value, layer = +$("layer").value, head = $("head").value;
    const map = shownMap();
    if (!map) return;
    const W = headWeights(map, head);
    drawHeatmap(map, W, norms(W));
    $("heatmap-title").textContent = "· " + module + " · layer " + layer + " · " + headName(head);

    const cross = state.task === "translation" ? mapsOf("decoder.cross") : [];
    $("alignment-panel").classList.toggle("hidden", !cross.length);
    if (cross.length) {
      const cm = cross.find((m) => m.layer === layer) || cross[cross.length - 1];
      const crossHead = headOf(cm, head), CW = headWeights(cm, crossHead);
      drawAlignment(cm, CW, norms(CW));
      $("alignment-title").textContent = "· decoder.cross · layer " + cm.layer + " · " + headName(crossHead);
    }

    const isVit = state.task === "image-classification";
    $("vit-panel").classList.toggle("hidden", !isVit);
    if (isVit) {
      drawVit(map, W);
      $("vit-title").textContent = "· " + module + " · layer " + layer + " · " + headName(head);
    }
  }

  // ------------------------------------------------------------------ heatmap (SVG)
  function drawHeatmap(map, W, scale) {  // scale: one divisor per row
    const box = $("heatmap"), q = map.query_tokens, k = map.key_tokens;
    const n = Math.max(q.length, k.length);
    const cell = Math.max(6, Math.min(28, Math.floor(640 / n)));
    const fontPx = Math.min(11, Math.max(8, cell - 2));
    const step = Math.ceil((fontPx + 1) / cell);  // label every step-th token when the cells are small
    const font = fontPx + "px ui-monospace, monospace";
    const labW = (toks) => Math.min(170, Math.ceil(Math.max(0, ...toks.map((t) => textWidth(shown(t), font)))) + 10);
    const left = labW(q), top = labW(k), legend = 34, lw = Math.min(200, Math.max(140, k.length * cell));
    const width = left + Math.max(k.length * cell, lw) + 8, height = top + q.length * cell + legend;
    const parts = [];
    parts.push("<svg xmlns=\"" + SVG_NS + "\" width=\"" + width + "\" height=\"" + height + "\" role=\"img\" " +
               "aria-label=\"attention heatmap\" style=\"font-size:" + fontPx + "px\">");
    for (let j = 0; j < k.length; j++) {
      const x = left + j * cell + cell / 2 + fontPx / 3;
      parts.push("<text class=\"klabel" + (j % step ? " minor" : "") + "\" id=\"klab-" + j + "\" style=\"font-size:" + fontPx + "px\" transform=\"translate(" +
                 x + "," + (top - 5) + ") rotate(-90)\">" + esc(shown(k[j])) + "</text>");
    }
    for (let i = 0; i < q.length; i++) {
      const y = top + i * cell + cell / 2 + fontPx / 3;
      parts.push("<text class=\"qlabel" + (i % step ? " minor" : "") + "\" id=\"qlab-" + i + "\" style=\"font-size:" + fontPx + "px\" x=\"" + (left - 5) +
                 "\" y=\"" + y + "\" text-anchor=\"end\">" + esc(shown(q[i])) + "</text>");
    }
    parts.push("<g class=\"cells\">");
    for (let i = 0; i < q.length; i++) {
      const row = W[i], y = top + i * cell, div = scale[i];
      for (let j = 0; j < k.length; j++) {
        parts.push("<rect class=\"cell\" x=\"" + (left + j * cell) + "\" y=\"" + y + "\" width=\"" + cell + "\" height=\"" +
                   cell + "\" fill=\"" + colour(row[j] / div) + "\" data-q=\"" + i + "\" data-k=\"" + j + "\"/>");
      }
    }
    parts.push("</g>");
    // colour legend
    const ly = top + q.length * cell + 14;
    parts.push("<defs><linearGradient id=\"ramp\">" + RAMP.map((c, i) => "<stop offset=\"" + (i / (RAMP.length - 1)) +
               "\" stop-color=\"rgb(" + c.join(",") + ")\"/>").join("") + "</linearGradient></defs>");
    parts.push("<rect x=\"" + left + "\" y=\"" + ly + "\" width=\"" + lw + "\" height=\"8\" fill=\"url(#ramp)\" stroke=\"#d7dce2\"/>");
    parts.push("<text x=\"" + left + "\" y=\"" + (ly + 19) + "\">0</text>");
    parts.push("<text x=\"" + (left + lw) + "\" y=\"" + (ly + 19) + "\" text-anchor=\"end\">" + esc(scaleLabel(scale)) + "</text>");
    parts.push("</svg>");
    box.innerHTML = parts.join("");
    box._map = map; box._W = W;
    box.dataset.rows = q.length;
    box.dataset.cols = k.length;
    box.dataset.rendered = "true";
  }

  let hotLabels = [];
  $("heatmap").addEventListener("mouseover", (ev) => {
    const t = ev.target;
    for (const el of hotLabels) el.classList.remove("hot");
    hotLabels = [];
    if (!t.classList || !t.classList.contains("cell")) { hideTip(); return; }
    const box = $("heatmap"), i = +t.dataset.q, j = +t.dataset.k, m = box._map;
    const w = box._W[i][j];
    hotLabels = [$("qlab-" + i), $("klab-" + j)].filter(Boolean);
    for (const el of hotLabels) el.classList.add("hot");
    showTip("query [" + i + "] " + shown(m.query_tokens[i]) + "\nkey   [" + j + "] " + shown(m.key_tokens[j]) +
            "\nweight " + fmt(w), ev);
  });
  $("heatmap").addEventListener("mousemove", (ev) => {
    if (!tip.classList.contains("hidden") && ev.target.classList && ev.target.classList.contains("cell")) {
      showTip(tip.textContent, ev);
    }
  });
  $("heatmap").addEventListener("mouseleave", () => {
    hideTip();
    for (const el of hotLabels) el.classList.remove("hot");
    hotLabels = [];
  });

  // ------------------------------------------------------------------ alignment (SVG)
  function drawAlignment(map, W, scale) {  // scale: one divisor per target row
    const box = $("alignment"), src = map.key_tokens, tgt = map.query_tokens;
    const font = "12px ui-monospace, monospace", gap = 6, h = 22;
    const widths = (toks) => toks.map((t) => Math.max(26, Math.ceil(textWidth(shown(t), font)) + 12));
    const sw = widths(src), tw = widths(tgt);
    const rowW = (ws) => ws.reduce((a, b) => a + b, 0) + gap * Math.max(0, ws.length - 1);
    const width = Math.max(rowW(sw), rowW(tw)) + 20;
    const ySrc = 8, yTgt = 8 + h + Math.max(120, Math.min(220, 6 * Math.max(src.length, tgt.length)));
    const place = (ws) => {
      let x = (width - rowW(ws)) / 2;
      return ws.map((w) => { const at = x; x += w + gap; return at; });
    };
    const sx = place(sw), tx = place(tw);
    const parts = ["<svg xmlns=\"" + SVG_NS + "\" width=\"" + width + "\" height=\"" + (yTgt + h + 8) +
                   "\" role=\"img\" aria-label=\"cross-attention alignment\">"];
    parts.push("<g class=\"links\">");
    for (let i = 0; i < tgt.length; i++) {
      for (let j = 0; j < src.length; j++) {
        const v = Math.max(0, Math.min(1, W[i][j] / scale[i]));
        parts.push("<line class=\"link\" data-q=\"" + i + "\" data-k=\"" + j + "\" x1=\"" + (sx[j] + sw[j] / 2) + "\" y1=\"" +
                   (ySrc + h) + "\" x2=\"" + (tx[i] + tw[i] / 2) + "\" y2=\"" + yTgt + "\" stroke=\"#1f5fbf\" stroke-opacity=\"" +
                   v.toFixed(3) + "\" stroke-width=\"" + (0.5 + 5 * v).toFixed(2) + "\" stroke-linecap=\"round\"/>");
      }
    }
    parts.push("</g>");
    const tok = (cls, i, x, y, w, t) => "<g class=\"tok " + cls + "\" data-i=\"" + i + "\"><rect x=\"" + x + "\" y=\"" + y +
      "\" width=\"" + w + "\" height=\"" + h + "\" rx=\"4\"/><text x=\"" + (x + w / 2) + "\" y=\"" + (y + 15) +
      "\" text-anchor=\"middle\">" + esc(shown(t)) + "</text></g>";
    src.forEach((t, j) => parts.push(tok("src", j, sx[j], ySrc, sw[j], t)));
    tgt.forEach((t, i) => parts.push(tok("tgt", i, tx[i], yTgt, tw[i], t)));
    parts.push("</svg>");
    box.innerHTML = parts.join("");
    box._map = map; box._W = W;
    box.dataset.sources = src.length;
    box.dataset.targets = tgt.length;
    box.dataset.rendered = "true";
  }

  function clearFocus(svg) {
    svg.classList.remove("focus");
    for (const el of svg.querySelectorAll(".on")) el.classList.remove("on");
  }
  $("alignment").addEventListener("mouseover", (ev) => {
    const box = $("alignment"), svg = box.querySelector("svg");
    if (!svg) return;
    const m = box._map, W = box._W;
    const line = ev.target.closest ? ev.target.closest(".link") : null;
    const tokEl = ev.target.closest ? ev.target.closest(".tok") : null;
    clearFocus(svg);
    if (line) {
      const i = +line.dataset.q, j = +line.dataset.k;
      showTip("target [" + i + "] " + shown(m.query_tokens[i]) + "\nsource [" + j + "] " + shown(m.key_tokens[j]) +
              "\nweight " + fmt(W[i][j]), ev);
    } else if (tokEl) {
      const i = +tokEl.dataset.i, isSrc = tokEl.classList.contains("src");
      svg.classList.add("focus");
      tokEl.classList.add("on");
      for (const l of svg.querySelectorAll(".link[data-" + (isSrc ? "k" : "q") + "=\"" + i + "\"]")) l.classList.add("on");
      let best = -1, bw = -1;
      const n = isSrc ? m.query_tokens.length : m.key_tokens.length;
      for (let o = 0; o < n; o++) { const w = isSrc ? W[o][i] : W[i][o]; if (w > bw) { bw = w; best = o; } }
      const other = isSrc ? m.query_tokens[best] : m.key_tokens[best];
      showTip((isSrc ? "source [" : "target [") + i + "] " + shown(isSrc ? m.key_tokens[i] : m.query_tokens[i]) +
              "\nstrongest: " + shown(other) + " (" + fmt(bw) + ")", ev);
    } else {
      hideTip();
    }
  });
  $("alignment").addEventListener("mouseleave", () => {
    hideTip();
    const svg = $("alignment").querySelector("svg");
    if (svg) clearFocus(svg);
  });

  // ------------------------------------------------------------------ ViT: [CLS] over the patch grid (canvas)
  function drawVit(map, W) {
    const box = $("vit"), keys = map.key_tokens;
    const patches = [];
    keys.forEach((t, j) => {
      const m = /^patch\((\d+),(\d+)\)$/.exec(t);
      if (m) patches.push({ j: j, r: +m[1], c: +m[2] });
    });
    if (!patches.length) { box.innerHTML = "<p class=\"empty\">no patch tokens in this map</p>"; return; }
    const rows = 1 + Math.max(...patches.map((p) => p.r)), cols = 1 + Math.max(...patches.map((p) => p.c));
    const cls = keys.indexOf("[CLS]") >= 0 ? keys.indexOf("[CLS]") : 0;
    const qi = map.query_tokens.indexOf("[CLS]") >= 0 ? map.query_tokens.indexOf("[CLS]") : 0;
    const att = patches.map((p) => W[qi][p.j]);
    const lo = Math.min(...att), span = Math.max(...att) - lo || 1;  // stretched: smallest to largest
    const size = 280, gap = 12;
    const canvas = document.createElement("canvas");
    canvas.width = size * 2 + gap; canvas.height = size;
    canvas.id = "vit-canvas";
    const ctx = canvas.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
    const drawImage = (x) => {
      if (state.imageEl) { ctx.imageSmoothingEnabled = true; ctx.drawImage(state.imageEl, x, 0, size, size); }
      else { ctx.fillStyle = "#ddd"; ctx.fillRect(x, 0, size, size); }
    };
    drawImage(0);
    drawImage(size + gap);
    // dim the image, then light the patches in proportion to the attention
    ctx.fillStyle = "rgba(0,0,0,0.45)";
    ctx.fillRect(size + gap, 0, size, size);
    const pw = size / cols, ph = size / rows;
    patches.forEach((p, n) => {
      ctx.fillStyle = "rgba(255,40,0," + (0.85 * (att[n] - lo) / span).toFixed(3) + ")";
      ctx.fillRect(size + gap + p.c * pw, p.r * ph, pw, ph);
    });
    ctx.strokeStyle = "rgba(255,255,255,0.25)";
    for (let c = 1; c < cols; c++) { ctx.beginPath(); ctx.moveTo(size + gap + c * pw, 0); ctx.lineTo(size + gap + c * pw, size); ctx.stroke(); }
    for (let r = 1; r < rows; r++) { ctx.beginPath(); ctx.moveTo(size + gap, r * ph); ctx.lineTo(2 * size + gap, r * ph); ctx.stroke(); }
    box.innerHTML = "";
    box.appendChild(canvas);
    const info = document.createElement("div");
    info.className = "caption";
    info.textContent = rows + "×" + cols + " patches, coloured from the smallest weight (" + fmt(lo) + ") to the largest (" +
      fmt(lo + span) + "); [CLS] keeps " + fmt(W[qi][cls]) + " of its attention on itself";
    box.appendChild(info);
    canvas.addEventListener("mousemove", (ev) => {
      const rect = canvas.getBoundingClientRect();
      const x = (ev.clientX - rect.left) * canvas.width / rect.width - (size + gap), y = (ev.clientY - rect.top) * canvas.height / rect.height;
      if (x < 0 || x >= size || y < 0 || y >= size) { hideTip(); return; }
      const r = Math.floor(y / ph), c = Math.floor(x / pw), n = patches.findIndex((p) => p.r === r && p.c === c);
      if (n < 0) { hideTip(); return; }
      showTip("[CLS] → patch(" + r + "," + c + ")\nweight " + fmt(att[n]), ev);
    });
    canvas.addEventListener("mouseleave", hideTip);
    box.dataset.patches = patches.length;
    box.dataset.rendered = "true";
  }

  // ------------------------------------------------------------------ views (tabs)
  const ATTENTION_PANELS = ["selection-panel", "heatmap-panel"];
  function showView(name) {
    state.view = name;
    for (const tab of document.querySelectorAll("[role=tab]")) {
      tab.setAttribute("aria-selected", String(tab.dataset.view === name));
    }
    const attention = name === "attention";
    for (const id of ATTENTION_PANELS) $(id).classList.toggle("hidden", !attention);
    if (!attention) { $("alignment-panel").classList.add("hidden"); $("vit-panel").classList.add("hidden"); }
    for (const [other, view] of Object.entries(views)) view.show(other === name);
    $("submit").textContent = attention ? "Show attention" : views[name].label;
    document.body.dataset.view = name;
    hideTip();
    clearError();
    onModelChange();
    if (attention) render();
  }

  // ------------------------------------------------------------------ wiring
  for (const tab of document.querySelectorAll("[role=tab]")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }
  $("form").addEventListener("submit", submit);
  $("model").addEventListener("change", () => { clearError(); onModelChange(); });
  $("module").addEventListener("change", () => { fillLayers(); render(); });
  $("layer").addEventListener("change", () => { fillHeads(); render(); });
  for (const id of ["head", "scale"]) $(id).addEventListener("change", render);
  $("api-key").addEventListener("change", () => { clearError(); loadModels(); });
  $("alignment-panel").classList.add("hidden");
  $("vit-panel").classList.add("hidden");
  loadModels();

  window.tserveViewer = { $, state, views, api, esc, shown, textWidth, colour, fmt, showTip, hideTip, showError,
                          clearError, status, parseLayers, currentTask };
})();
