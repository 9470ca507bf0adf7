"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const DEBOUNCE_MS = 400;
  const ALTERNATIVES = 3;
  const BEAMS = 4;
  const KEY_STORAGE = "tserve.apiKey";
  const AUTO = "auto";

  const state = {
    languages: [],        // /languages: [{code, name, targets}]
    names: new Map(),     // code -> name
    keyRequired: false,
    charLimit: null,
    timer: 0,
    seq: 0,               // the latest translation asked for; older answers are dropped
    controller: null,
    plainPairs: new Set(),  // pairs whose model refused n / num_beams: asked without them from then on
    languagesFailed: false,
    keyTimer: 0,
  };

  // ------------------------------------------------------------------ API key
  function storedKey() {
    try { return localStorage.getItem(KEY_STORAGE) || ""; } catch (err) { return ""; }
  }
  function storeKey(key) {
    try {
      if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
    } catch (err) { /* storage disabled: the key lives in the field only */ }
  }
  function authHeaders() {
    const key = $("api-key").value.trim();
    return key ? { Authorization: "Bearer " + key } : {};
  }
  function showKeyPanel() { $("key-panel").classList.remove("hidden"); }
  function showKeyProblem(status, message) {
    showKeyPanel();
    const box = $("key-message");
    const typed = $("api-key").value.trim();
    box.textContent = (typed ? "The server refused this API key" : "This server needs an API key: enter it above") +
      " (HTTP " + status + ": " + message + ").";
    box.classList.remove("hidden");
  }
  function clearKeyProblem() { $("key-message").classList.add("hidden"); $("key-message").textContent = ""; }

  // ------------------------------------------------------------------ HTTP
  function errorText(data, resp) {
    if (data && typeof data.error === "string") return data.error;                     // LibreTranslate's routes
    if (data && data.error && typeof data.error.message === "string") return data.error.message;  // /v1
    if (data && typeof data.detail === "string") return data.detail;
    return resp.statusText || "request failed";
  }

  // `options`: {method, json, form, signal, raw, headers}. Paths are relative to the page, so it also works
  // behind a path prefix. Answers the parsed JSON (null for an empty body), or the response itself with `raw`.
  async function api(path, options) {
    const opts = options || {};
    const headers = Object.assign(authHeaders(), opts.headers || {});
    let body;
    if (opts.json !== undefined) { headers["Content-Type"] = "application/json"; body = JSON.stringify(opts.json); }
    if (opts.form !== undefined) body = opts.form;  // the browser writes the multipart boundary
    const method = opts.method || (body === undefined ? "GET" : "POST");
    let resp;
    try {
      resp = await fetch(path, { method, headers, body, signal: opts.signal });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new Error("could not reach the server: " + err.message);
    }
    if (opts.raw && resp.ok) return resp;
    const text = await resp.text();
    let data = null;
    if (text) {
      try { data = JSON.parse(text); } catch (err) { data = null; }
    }
    if (!resp.ok) {
      const message = errorText(data, resp);
      const error = new Error(message + " (HTTP " + resp.status + ")");
      error.status = resp.status;
      const fields = data && data.error && typeof data.error === "object" ? data.error : {};
      error.code = fields.code || null;
      error.param = fields.param || null;  // the request field the server refused
      if (resp.status === 401 || resp.status === 403) showKeyProblem(resp.status, message);
      throw error;
    }
    if (text && data === null) throw new Error("the server's answer to " + path + " is not JSON");
    return data;
  }

  // ------------------------------------------------------------------ messages
  function showError(message) { const e = $("error"); e.textContent = message; e.classList.remove("hidden"); }
  function clearError() { const e = $("error"); e.textContent = ""; e.classList.add("hidden"); }
  function setStatus(message, busy) {
    const s = $("status");
    s.textContent = message || "";
    s.classList.toggle("busy", !!busy);
    $("target-text").setAttribute("aria-busy", String(!!busy));
  }
  function languageName(code) { return state.names.get(code) || code; }

  // ------------------------------------------------------------------ language pickers
  function option(value, label) {
    const o = document.createElement("option");
    o.value = value;
    o.textContent = label;
    return o;
  }
  function byName(a, b) { return languageName(a).localeCompare(languageName(b)); }
  function servedPairs() {
    let count = 0;
    for (const lang of state.languages) count += lang.targets.length;
    return count;
  }
  function targetsOf(source) {
    if (source === AUTO) {
      const all = new Set();
      for (const lang of state.languages) for (const t of lang.targets) all.add(t);
      return [...all].sort(byName);
    }
    const lang = state.languages.find((l) => l.code === source);
    return lang ? [...lang.targets].sort(byName) : [];
  }

  function fillSources(preferred) {
    const select = $("source-lang");
    select.replaceChildren();
    const sources = state.languages.filter((l) => l.targets.length).map((l) => l.code).sort(byName);
    if (!sources.length) {  // the translator names no languages: it is asked without them
      select.appendChild(option("", "the model's language"));
      select.disabled = true;
      return;
    }
    select.disabled = false;
    select.appendChild(option(AUTO, "Auto detect"));
    for (const code of sources) select.appendChild(option(code, languageName(code)));
    select.value = [...select.options].some((o) => o.value === preferred) ? preferred : AUTO;
  }

  function fillTargets(preferred) {
    const select = $("target-lang");
    const wanted = preferred || select.value;
    select.replaceChildren();
    const targets = targetsOf($("source-lang").value);
    if (!targets.length) {
      select.appendChild(option("", state.languages.length ? "(none)" : "the model's language"));
      select.disabled = true;
    } else {
      select.disabled = false;
      for (const code of targets) select.appendChild(option(code, languageName(code)));
      select.value = targets.includes(wanted) ? wanted : targets[0];
    }
    updateSwap();
  }

  function updateSwap() {
    const source = $("source-lang").value, target = $("target-lang").value, swap = $("swap");
    let why = "";
    if (!source || !target) why = "no languages to swap";
    else if (source === AUTO) why = "pick a source language to swap (not Auto detect)";
    else if (!targetsOf(target).includes(source)) why = languageName(target) + " → " + languageName(source) + " is not served";
    swap.disabled = !!why;
    swap.title = why || "swap the languages and the texts";
  }

  async function loadLanguages() {
    let list = [], defaults = null;
    try {
      const settings = await api("frontend/settings");
      state.keyRequired = !!(settings && settings.keyRequired);
      state.charLimit = settings && settings.charLimit ? settings.charLimit : null;
      defaults = settings && settings.language ? settings.language : null;
    } catch (err) { /* an older server: the key field shows on the first 401 */ }
    if (state.keyRequired || storedKey()) showKeyPanel();
    updateCount();
    state.languagesFailed = false;
    try {
      list = await api("languages");
    } catch (err) {
      state.languagesFailed = true;  // behind the key, say: read again once a key is typed
      showError("could not read the served languages: " + err.message);
    }
    state.languages = Array.isArray(list) ? list : [];
    state.names = new Map(state.languages.map((l) => [l.code, l.name || l.code]));
    // One pair: that pair; several: Auto detect, the target the server suggests.
    const preferredSource = servedPairs() === 1 ? state.languages.find((l) => l.targets.length).code : AUTO;
    fillSources(preferredSource);
    fillTargets(defaults && defaults.target ? defaults.target.code : "");
    document.body.dataset.ready = "true";
    if ($("source-text").value.trim()) translateNow();
  }

  // ------------------------------------------------------------------ live translation
  function updateCount() {
    const n = $("source-text").value.length;
    const limit = state.charLimit ? " / " + state.charLimit.toLocaleString("en") : "";
    $("char-count").textContent = n.toLocaleString("en") + limit + " characters";
  }

  function scheduleTranslation() {
    clearTimeout(state.timer);
    state.timer = setTimeout(translateNow, DEBOUNCE_MS);
  }

  // Only the server's refusal of n or num_beams themselves (by the field it names, never by the message's
  // words): any other 400 is about this text and is shown, and the pair keeps its alternatives.
  function refusedOptions(err) {
    if (err.status !== 400 && err.status !== 422) return false;
    return err.param === "n" || err.param === "num_beams";
  }

  async function translateText(text, source, target, signal) {
    const body = { input: text };
    if (source) body.source_lang = source;
    if (target) body.target_lang = target;
    const pair = source + ">" + target;
    if (!state.plainPairs.has(pair)) {
      try {
        return await api("v1/translations", { json: Object.assign({ n: ALTERNATIVES, num_beams: BEAMS }, body), signal });
      } catch (err) {
        if (!refusedOptions(err)) throw err;
        state.plainPairs.add(pair);
      }
    }
    return api("v1/translations", { json: body, signal });
  }

  function showDetected(found) {
    const box = $("detected");
    if (!found) { box.textContent = ""; delete box.dataset.language; return; }
    box.textContent = "Detected: " + languageName(found.language) +
      (typeof found.confidence === "number" ? " (" + Math.round(found.confidence) + "%)" : "");
    box.dataset.language = found.language;
  }

  async function translateNow() {
    clearTimeout(state.timer);
    const seq = ++state.seq;
    if (state.controller) state.controller.abort();
    const controller = state.controller = new AbortController();
    const text = $("source-text").value;
    const source = $("source-lang").value, target = $("target-lang").value;
    clearError();
    if (source !== AUTO) showDetected(null);
    if (!text.trim()) {
      showTranslation(null);
      setStatus("");
      return;
    }
    setStatus("Translating…", true);
    try {
      let from = source;
      if (source === AUTO) {
        const found = await api("detect", { json: { q: text }, signal: controller.signal });
        if (seq !== state.seq) return;
        if (!Array.isArray(found) || !found.length) throw new Error("the language of this text could not be detected");
        showDetected(found[0]);
        from = found[0].language;
      }
      let answer;
      if (source === AUTO && from === target) {  // already in the target language: nothing to translate
        answer = { data: [{ translation: text }], model: null, note: "already in " + languageName(target) };
      } else {
        answer = await translateText(text, from, target, controller.signal);
      }
      if (seq !== state.seq) return;
      if (!answer || !Array.isArray(answer.data) || !answer.data.length) throw new Error("the answer holds no translation");
      clearKeyProblem();
      showTranslation(text, answer);
      setStatus(answer.note || "");
    } catch (err) {
      if (seq !== state.seq || err.name === "AbortError") return;
      setStatus("");
      showError(err.message);
    }
  }

  // ------------------------------------------------------------------ the answer
  function formatScore(score) { return typeof score === "number" ? score.toFixed(3) : ""; }

  function choose(button) {
    for (const b of $("alternatives").querySelectorAll("button")) b.setAttribute("aria-pressed", String(b === button));
    $("target-text").value = button.dataset.translation;
    $("copy").disabled = !button.dataset.translation;
  }

  function showTranslation(source, answer) {
    const out = $("target-text"), list = $("alternatives");
    list.replaceChildren();
    if (!answer) {
      out.value = "";
      delete out.dataset.source;
      $("model-used").textContent = "";
      $("alternatives-box").classList.add("hidden");
      $("copy").disabled = true;
      return;
    }
    const best = answer.data[0];
    out.value = best.translation;
    out.dataset.source = source;
    $("copy").disabled = !best.translation;
    const models = Array.isArray(answer.models) && answer.models.length > 1 ? answer.models.join(" → ") : answer.model;
    $("model-used").textContent = models ? "model: " + models : "";
    const alternatives = Array.isArray(best.alternatives) ? best.alternatives : [];
    alternatives.forEach((alt, i) => {
      const item = document.createElement("li");
      const button = document.createElement("button");
      button.type = "button";
      button.className = "alternative";
      button.dataset.translation = alt.translation;
      button.dataset.score = String(alt.score);
      button.setAttribute("aria-pressed", String(i === 0 && alt.translation === best.translation));
      const words = document.createElement("span");
      words.className = "alt-text";
      words.textContent = alt.translation;
      const score = document.createElement("span");
      score.className = "alt-score";
      score.textContent = "score " + formatScore(alt.score);
      button.append(words, score);
      button.addEventListener("click", () => choose(button));
      item.appendChild(button);
      list.appendChild(item);
    });
    $("alternatives-box").classList.toggle("hidden", alternatives.length < 2);
  }

  // ------------------------------------------------------------------ swap, copy, clear
  function swap() {
    const source = $("source-lang").value, target = $("target-lang").value;
    if (source === AUTO || $("swap").disabled) return;
    const sourceText = $("source-text").value;
    $("source-lang").value = target;
    fillTargets(source);
    $("source-text").value = $("target-text").value;
    $("target-text").value = sourceText;
    $("alternatives-box").classList.add("hidden");
    updateCount();
    translateNow();
  }

  function copyBySelection(text) {
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (err) { ok = false; }
    area.remove();
    return ok;
  }

  async function copyTarget() {
    const text = $("target-text").value, button = $("copy");
    if (!text) return;
    let ok = false;
    if (navigator.clipboard && window.isSecureContext) {
      try { await navigator.clipboard.writeText(text); ok = true; } catch (err) { ok = false; }
    }
    if (!ok) ok = copyBySelection(text);
    button.textContent = ok ? "Copied" : "Copy failed: select the text";
    button.dataset.copied = String(ok);
    setTimeout(() => { button.textContent = "Copy"; }, 1600);
  }

  // ------------------------------------------------------------------ wiring
  $("api-key").value = storedKey();
  $("api-key").addEventListener("input", () => {
    storeKey($("api-key").value.trim());
    clearKeyProblem();
    if (state.languagesFailed) {
      clearTimeout(state.keyTimer);
      state.keyTimer = setTimeout(loadLanguages, DEBOUNCE_MS);
    } else if ($("source-text").value.trim()) {
      scheduleTranslation();
    }
  });
  $("key-form").addEventListener("submit", (ev) => { ev.preventDefault(); translateNow(); });
  $("key-show").addEventListener("click", () => {
    const field = $("api-key"), hidden = field.type === "password";
    field.type = hidden ? "text" : "password";
    $("key-show").textContent = hidden ? "Hide" : "Show";
  });
  $("source-text").addEventListener("input", () => { updateCount(); scheduleTranslation(); });
  $("source-lang").addEventListener("change", () => { fillTargets(); translateNow(); });
  $("target-lang").addEventListener("change", () => { updateSwap(); translateNow(); });
  $("swap").addEventListener("click", swap);
  $("copy").addEventListener("click", copyTarget);
  $("clear").addEventListener("click", () => {
    $("source-text").value = "";
    updateCount();
    translateNow();
    $("source-text").focus();
  });

  window.tservePage = { $, api, state, languageName, servedPairs, AUTO };
  loadLanguages();
})();
