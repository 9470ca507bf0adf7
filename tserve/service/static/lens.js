"use strict";
// The "logit lens" view of /viewer: a layers × positions grid from POST /v1/logit_lens. Each cell shows the
// most likely next token if the model stopped after that layer, coloured by its probability; hover for the top-k.
(function () {
  const v = window.tserveViewer, $ = v.$;
  const LENS_TASKS = ["text-generation", "translation"];
  const lens = { answer: null };

  function show(on) {
    $("lens-panel").classList.toggle("hidden", !on);
    $("top-k-row").classList.toggle("hidden", !on);
  }

  function topK() {
    const text = $("top-k").value.trim(), k = Number(text);
    if (!/^\d+$/.test(text) || k < 1 || k > 20) throw new Error("top-k: give a whole number from 1 to 20");
    return k;
  }

  async function submit() {
    const model = $("model").value, task = v.currentTask();
    if (!model) { v.showError("pick a model first"); return; }
    if (!LENS_TASKS.includes(task)) { v.showError("the logit lens reads language models and translators"); return; }
    const body = { model: model, input: $("input").value };
    if (!body.input.trim()) { v.showError("type some text first"); return; }
    try {
      const layers = v.parseLayers($("fetch-layers").value);
      if (layers) body.layers = layers;
      body.top_k = topK();
    } catch (err) { v.showError(err.message); return; }
    const target = $("target").value;
    if (task === "translation" && target.trim()) body.target = target;
    $("lens").dataset.rendered = "false";
    $("submit").disabled = true;
    v.status("computing the logit lens…");
    const t0 = performance.now();
    try {
      const answer = await v.api("v1/logit_lens", body);
      if (!answer.layers || !answer.layers.length) throw new Error("the answer holds no layers");
      lens.answer = answer;
      v.status("model " + answer.model + ": " + answer.layers.length + " layers × " + answer.tokens.length +
               " positions in " + Math.round(performance.now() - t0) + " ms");
      draw(answer, task);
    } catch (err) {
      v.status("");
      v.showError(err.message);
    } finally {
      $("submit").disabled = false;
    }
  }

  function clip(label, width, font) {  // a label that fits its cell, with an ellipsis when cut
    if (v.textWidth(label, font) <= width) return label;
    let s = label;
    while (s.length > 1 && v.textWidth(s + "…", font) > width) s = s.slice(0, -1);
    return s + "…";
  }

  function draw(answer, task) {
    const box = $("lens"), tokens = answer.tokens, rows = answer.layers.slice().reverse();  // last layer on top
    const font = "11px ui-monospace, monospace";
    const cellW = 66, cellH = 24, labelW = 92, foot = 26;
    const width = labelW + tokens.length * cellW, height = rows.length * cellH + foot;
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    const add = (parent, name, attrs, text) => {
      const el = document.createElementNS("http://www.w3.org/2000/svg", name);
      for (const [k, val] of Object.entries(attrs)) el.setAttribute(k, val);
      if (text !== undefined) el.textContent = text;
      parent.appendChild(el);
      return el;
    };
    rows.forEach((layer, r) => {
      const y = r * cellH;
      add(svg, "text", { x: labelW - 8, y: y + cellH / 2 + 4, "text-anchor": "end", class: "llabel" },
          layer.layer === 0 ? "0 · embed" : "layer " + layer.layer);
      layer.positions.forEach((pos, j) => {
        const best = pos.top[0], x = labelW + j * cellW;
        const next = j + 1 < tokens.length ? tokens[j + 1] : null;
        const rect = add(svg, "rect", { x: x, y: y, width: cellW - 1, height: cellH - 1, fill: v.colour(best.prob),
                                        class: "lcell" });
        rect.dataset.layer = layer.layer;
        rect.dataset.pos = j;
        rect.dataset.prob = best.prob;
        const cls = "top" + (best.prob > 0.5 ? " light" : "") + (best.token === next ? " hit" : "");
        const label = add(svg, "text", { x: x + cellW / 2, y: y + cellH / 2 + 4, "text-anchor": "middle",
                                         class: cls, "pointer-events": "none" },
                          clip(v.shown(best.token), cellW - 6, font));
        label.dataset.token = best.token;
        rect.addEventListener("mousemove", (ev) => v.showTip(tipText(layer.layer, j, tokens, pos), ev));
        rect.addEventListener("mouseleave", v.hideTip);
      });
    });
    tokens.forEach((tok, j) => {
      add(svg, "text", { x: labelW + j * cellW + cellW / 2, y: rows.length * cellH + 16, "text-anchor": "middle",
                         class: "plabel" }, clip(v.shown(tok), cellW - 4, font));
    });
    box.innerHTML = "";
    box.appendChild(svg);
    box.dataset.rows = rows.length;
    box.dataset.cols = tokens.length;
    $("lens-title").textContent = "· " + answer.model + (task === "translation" ? " · decoder over the target" : "");
    const what = document.createElement("div");
    what.className = "caption";
    what.textContent = task === "translation"
      ? "Target read (after the start token): " + tokens.slice(1).join("")
      : tokens.length + " input tokens";
    box.appendChild(what);
    box.dataset.rendered = "true";
  }

  function tipText(layer, j, tokens, pos) {
    const head = (layer === 0 ? "embeddings" : "layer " + layer) + " · after " + v.shown(tokens[j]) +
                 (j + 1 < tokens.length ? " (next: " + v.shown(tokens[j + 1]) + ")" : "");
    return head + "\n" + pos.top.map((t, i) => (i + 1) + ". " + v.shown(t.token) + "  " + v.fmt(t.prob)).join("\n");
  }

  v.views.lens = { label: "Show logit lens", submit: submit, show: show,
                   accepts: (task) => LENS_TASKS.includes(task) };
})();
