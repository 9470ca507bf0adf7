"use strict";
// The "document" view of /viewer: a translation from POST /v1/translations with return_alignment. Each segment
// (a sentence; for HTML, a block) shows its source and target words joined by the word alignment the server
// computed from the model's cross-attention, and, for HTML, where each inline tag went: a coloured bar over the
// source words a tag wrapped and the same colour over the target words it was placed around.
(function () {
  const v = window.tserveViewer, $ = v.$;
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#d9480f", "#2b8a3e", "#862e9c", "#1864ab", "#e67700", "#c2255c", "#0b7285", "#5c940d"];
  const doc = { answer: null };

  function show(on) {
    $("document-panel").classList.toggle("hidden", !on);
    $("format-row").classList.toggle("hidden", !on);
  }

  async function submit() {
    const model = $("model").value, task = v.currentTask();
    if (!model) { v.showError("pick a model first"); return; }
    if (task !== "translation") { v.showError("the document view reads translators"); return; }
    const body = { model: model, input: $("input").value, format: $("doc-format").value, return_alignment: true };
    if (!body.input.trim()) { v.showError("type some text first"); return; }
    $("document").dataset.rendered = "false";
    $("submit").disabled = true;
    v.status("translating…");
    const t0 = performance.now();
    try {
      const answer = await v.api("v1/translations", body);
      const item = answer.data && answer.data[0];
      if (!item || !item.segments) throw new Error("the answer holds no segments");
      doc.answer = answer;
      v.status("model " + answer.model + ": " + item.segments.length + " segment" +
               (item.segments.length === 1 ? "" : "s") + " in " + Math.round(performance.now() - t0) + " ms");
      draw(item, body.format);
    } catch (err) {
      v.status("");
      v.showError(err.message);
    } finally {
      $("submit").disabled = false;
    }
  }

  // "<a href=…>" -> "<a>", a comment -> "<!-- -->": what a bar's label says.
  function tagName(raw) {
    const m = /^<\s*([A-Za-z][\w:-]*)/.exec(raw);
    if (m) return "<" + m[1].toLowerCase() + ">";
    return raw.startsWith("<!--") ? "<!-- -->" : raw.slice(0, 12);
  }

  function add(parent, name, attrs, text) {
    const el = document.createElementNS(SVG, name);
    for (const [k, val] of Object.entries(attrs)) el.setAttribute(k, val);
    if (text !== undefined) el.textContent = text;
    parent.appendChild(el);
    return el;
  }

  function wordsText(words, idx) { return idx.map((i) => words[i]).join(" "); }

  // One segment: source chips on top, target chips below, a line per aligned target word, tag bars outside.
  function drawSegment(seg, n) {
    const font = "12px ui-monospace, monospace", gap = 6, h = 22, barH = 5, barGap = 14;
    const tags = seg.tags || [];
    const depth = tags.reduce((m, t) => Math.max(m, t.depth + 1), 0);
    const widths = (ws) => ws.map((w) => Math.max(24, Math.ceil(v.textWidth(w, font)) + 12));
    const sw = widths(seg.source_words), tw = widths(seg.target_words);
    const rowW = (ws) => ws.reduce((a, b) => a + b, 0) + gap * Math.max(0, ws.length - 1);
    const width = Math.max(rowW(sw), rowW(tw), 120) + 24;
    const ySrc = 8 + depth * barGap, yTgt = ySrc + h + Math.max(70, Math.min(160, 5 * seg.target_words.length));
    const height = yTgt + h + 8 + depth * barGap;
    const place = (ws) => { let x = 12; return ws.map((w) => { const at = x; x += w + gap; return at; }); };
    const sx = place(sw), tx = place(tw);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", "word alignment of segment " + n);
    const links = add(svg, "g", { class: "links" });
    seg.alignment.forEach((s, t) => {
      if (s < 0 || s >= sw.length) return;
      const line = add(links, "line", { class: "aln", x1: sx[s] + sw[s] / 2, y1: ySrc + h, x2: tx[t] + tw[t] / 2, y2: yTgt,
                                        stroke: "#1f5fbf", "stroke-width": 2, "stroke-linecap": "round" });
      line.dataset.s = s;
      line.dataset.t = t;
    });
    const chip = (cls, i, x, y, w, text) => {
      const g = add(svg, "g", { class: "word " + cls });
      g.dataset.i = i;
      add(g, "rect", { x: x, y: y, width: w, height: h, rx: 4 });
      add(g, "text", { x: x + w / 2, y: y + 15, "text-anchor": "middle" }, text);
      return g;
    };
    seg.source_words.forEach((w, i) => chip("src", i, sx[i], ySrc, sw[i], w));
    seg.target_words.forEach((w, i) => chip("tgt", i, tx[i], yTgt, tw[i], w));
    // Tag bars: above the source words a span wrapped, below the target words it was placed around; atoms are
    // ticks at the word boundary where they stand.
    const edge = (xs, ws, b) => (b <= 0 ? xs.length ? xs[0] - gap / 2 : 12
      : b >= xs.length ? xs[xs.length - 1] + ws[ws.length - 1] + gap / 2 : xs[b] - gap / 2);
    tags.forEach((tag, k) => {
      const colour = PALETTE[k % PALETTE.length], g = add(svg, "g", { class: "tagmark" });
      g.dataset.tag = k;
      const ys = ySrc - 4 - (tag.depth + 1) * barGap + barGap - barH, yt = yTgt + h + 4 + tag.depth * barGap;
      const bar = (xs, ws, idx, y, side) => {
        if (!idx.length) return;
        const a = Math.min(...idx), b = Math.max(...idx), x0 = xs[a], x1 = xs[b] + ws[b];
        add(g, "rect", { class: "bar " + side, x: x0, y: y, width: x1 - x0, height: barH, fill: colour, rx: 2 });
        add(g, "text", { class: "barlabel", x: x0, y: side === "src" ? y - 1 : y + barH + 9, fill: colour }, tagName(tag.tag));
      };
      const tick = (x, y, side) => {
        add(g, "rect", { class: "tick " + side, x: x - 1.5, y: y - 2, width: 3, height: barH + 6, fill: colour });
        add(g, "text", { class: "barlabel", x: x + 3, y: side === "src" ? y - 1 : y + barH + 9, fill: colour }, tagName(tag.tag));
      };
      if (tag.kind === "atom") {
        tick(edge(sx, sw, tag.source_boundary), ys, "src");
        tick(edge(tx, tw, tag.target_boundary), yt, "tgt");
      } else {
        bar(sx, sw, tag.source_words, ys, "src");
        bar(tx, tw, tag.target_words, yt, "tgt");
      }
    });
    return svg;
  }

  function tagTable(seg) {
    const table = document.createElement("table");
    table.className = "tags";
    table.innerHTML = "<thead><tr><th>tag</th><th>source words</th><th>placed on target words</th></tr></thead>";
    const body = document.createElement("tbody");
    (seg.tags || []).forEach((tag, k) => {
      const tr = document.createElement("tr");
      tr.dataset.tag = k;
      const cells = tag.kind === "atom"
        ? [tag.tag, "before word " + tag.source_boundary + (tag.source_boundary < seg.source_words.length
            ? " (" + seg.source_words[tag.source_boundary] + ")" : " (end)"),
           "before word " + tag.target_boundary + (tag.target_boundary < seg.target_words.length
             ? " (" + seg.target_words[tag.target_boundary] + ")" : " (end)")]
        : [tag.tag, wordsText(seg.source_words, tag.source_words), wordsText(seg.target_words, tag.target_words) || "(empty)"];
      cells.forEach((text, c) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (c === 0) { td.style.borderLeft = "4px solid " + PALETTE[k % PALETTE.length]; td.className = "tagcode"; }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
    table.appendChild(body);
    return table;
  }

  function draw(item, format) {
    const box = $("document");
    box.innerHTML = "";
    const out = document.createElement("div");
    out.className = "caption";
    out.textContent = format === "html" ? "The translated page (its HTML source):" : "The translation:";
    box.appendChild(out);
    const pre = document.createElement("pre");
    pre.id = "doc-translation";
    pre.textContent = item.translation;  // as text: the page's markup is shown, never run
    box.appendChild(pre);
    item.segments.forEach((seg, n) => {
      const sec = document.createElement("div");
      sec.className = "segment";
      sec.dataset.segment = n;
      const head = document.createElement("div");
      head.className = "caption";
      head.textContent = "Segment " + (n + 1) + " · " + seg.source_words.length + " → " + seg.target_words.length +
        " words" + (seg.tags ? " · " + seg.tags.length + " tag" + (seg.tags.length === 1 ? "" : "s") : "");
      sec.appendChild(head);
      const svg = drawSegment(seg, n);
      sec.appendChild(svg);
      if (seg.tags && seg.tags.length) sec.appendChild(tagTable(seg));
      svg.addEventListener("mouseover", (ev) => focus(ev, seg, svg));
      svg.addEventListener("mouseleave", () => { v.hideTip(); clear(svg); });
      box.appendChild(sec);
    });
    $("document-title").textContent = "· " + doc.answer.model + " · " + format;
    box.dataset.segments = item.segments.length;
    box.dataset.rendered = "true";
  }

  function clear(svg) {
    svg.classList.remove("focus");
    for (const el of svg.querySelectorAll(".on")) el.classList.remove("on");
  }

  // Hover a word: its alignment lines and the words at their other ends light up; the tooltip names them.
  function focus(ev, seg, svg) {
    clear(svg);
    const word = ev.target.closest ? ev.target.closest(".word") : null;
    if (!word) { v.hideTip(); return; }
    const i = +word.dataset.i, isSrc = word.classList.contains("src");
    svg.classList.add("focus");
    word.classList.add("on");
    const other = [];
    for (const line of svg.querySelectorAll(".aln[data-" + (isSrc ? "s" : "t") + "=\"" + i + "\"]")) {
      line.classList.add("on");
      const j = +line.dataset[isSrc ? "t" : "s"];
      other.push(j);
      const chip = svg.querySelector(".word." + (isSrc ? "tgt" : "src") + "[data-i=\"" + j + "\"]");
      if (chip) chip.classList.add("on");
    }
    const own = isSrc ? seg.source_words[i] : seg.target_words[i];
    const words = isSrc ? seg.target_words : seg.source_words;
    const tags = (seg.tags || []).filter((t) => t.kind === "span" && (isSrc ? t.source_words : t.target_words).includes(i));
    v.showTip((isSrc ? "source [" : "target [") + i + "] " + own + "\n" +
              (isSrc ? "read by: " : "read from: ") + (other.length ? other.map((j) => words[j]).join(" ") : "(none)") +
              (tags.length ? "\ninside: " + tags.map((t) => tagName(t.tag)).join(" ") : ""), ev);
  }

  v.views.document = { label: "Translate", submit: submit, show: show,
                       accepts: (task) => task === "translation" };
})();
