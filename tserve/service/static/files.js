"use strict";
(function () {
  const page = window.tservePage;
  const $ = page.$;
  const ACCEPTED = [".txt", ".md", ".html", ".htm", ".docx", ".pptx", ".odt", ".odp", ".srt", ".vtt", ".epub"];
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  const STATUS_TEXT = { uploading: "Uploading…", queued: "Queued", running: "Translating…", succeeded: "Done",
                        failed: "Failed", cancelled: "Cancelled" };
  const POLL_MS = 1000;

  // The job on show: {id, name, target, controller, done, url}. A new file replaces it.
  let current = null;

  function showFileError(message) { const e = $("file-error"); e.textContent = message; e.classList.remove("hidden"); }
  function clearFileError() { const e = $("file-error"); e.textContent = ""; e.classList.add("hidden"); }
  function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }
  function relative(url) { return String(url).replace(/^\/+/, ""); }  // page-relative, as every other call

  function accepted(name) {
    const lower = name.toLowerCase();
    return ACCEPTED.some((ext) => lower.endsWith(ext));
  }

  // The languages a file is sent with, or {problem}: a file's language is not detected.
  function fileLanguages() {
    const source = $("source-lang").value, target = $("target-lang").value;
    if (source !== page.AUTO) return { source, target };
    if (page.servedPairs() === 1) return { source: "", target };
    return { problem: "Choose the file's language in From: a file's language is not detected (Auto detect " +
                      "works for typed text only)." };
  }

  function render(entry, job) {
    const status = job.status || "queued";
    $("job").classList.remove("hidden");
    $("job").dataset.status = status;
    $("job-name").textContent = job.filename || entry.name;
    $("job-status").textContent = STATUS_TEXT[status] || status;
    const done = Number(job.done_segments) || 0, total = Number(job.total_segments) || 0;
    const bar = $("job-progress");
    if (status === "succeeded") {
      bar.max = Math.max(total, 1);
      bar.value = bar.max;
    } else if (total > 0) {
      bar.max = total;
      bar.value = Math.min(done, total);
    } else if (status === "queued" || status === "running" || status === "uploading") {
      bar.removeAttribute("value");  // indeterminate until the file's segments are counted
    }
    bar.dataset.done = String(done);
    bar.dataset.total = String(total);
    $("job-count").textContent = total > 0 ? done + " / " + total + " segments" : "";
    $("job-cancel").classList.toggle("hidden", TERMINAL.has(status) || !entry.id);
    if (status === "failed") {
      const message = job.error && job.error.message ? job.error.message : "the translation failed";
      showFileError(message);
    }
  }

  function apply(entry, job) {
    if (entry !== current || entry.done || !job || typeof job !== "object") return;
    render(entry, job);
    if (!TERMINAL.has(job.status)) return;
    entry.done = true;
    if (job.status === "succeeded") download(entry, job);
  }

  function dataOf(block) {
    const lines = block.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
    if (!lines.length) return null;
    try { return JSON.parse(lines.join("\n")); } catch (err) { return null; }
  }

  // The event stream through fetch (EventSource cannot send the key); polling where the stream fails or ends
  // before the job does.
  async function follow(entry) {
    try {
      const resp = await page.api("v1/translations/jobs/" + encodeURIComponent(entry.id) + "/events",
                                  { raw: true, signal: entry.controller.signal, headers: { Accept: "text/event-stream" } });
      if (resp.body) {
        const reader = resp.body.getReader(), decoder = new TextDecoder();
        let buffer = "";
        while (!entry.done) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += decoder.decode(value, { stream: true });
          let end;
          while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
            const block = buffer.slice(0, end);
            buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
            apply(entry, dataOf(block));
          }
        }
        if (entry.done) reader.cancel().catch(() => {});
      }
    } catch (err) {
      if (err.name === "AbortError" || entry !== current) return;
    }
    if (!entry.done && entry === current) await poll(entry);
  }

  async function poll(entry) {
    while (!entry.done && entry === current) {
      try {
        apply(entry, await page.api("v1/translations/jobs/" + encodeURIComponent(entry.id),
                                    { signal: entry.controller.signal }));
      } catch (err) {
        if (err.name !== "AbortError" && entry === current) showFileError(err.message);
        return;
      }
      if (!entry.done) await sleep(POLL_MS);
    }
  }

  async function download(entry, job) {
    const link = $("job-download");
    try {
      const resp = await page.api(relative(job.download_url || "v1/translations/jobs/" + entry.id + "/file"),
                                  { raw: true, signal: entry.controller.signal });
      const blob = await resp.blob();
      if (entry !== current) return;
      entry.url = URL.createObjectURL(blob);
      const target = entry.target || job.target_lang;
      const name = (target ? target + "-" : "translated-") + (job.filename || entry.name);
      link.href = entry.url;
      link.download = name;
      link.textContent = "Download " + name;
      link.classList.remove("hidden");
    } catch (err) {
      if (err.name !== "AbortError" && entry === current) showFileError("could not download the translation: " + err.message);
    }
  }

  function forget(entry) {
    if (!entry) return;
    entry.controller.abort();
    if (entry.url) URL.revokeObjectURL(entry.url);
  }

  async function start(file) {
    clearFileError();
    if (!accepted(file.name)) {
      showFileError(file.name + ": not a file type translated here (" + ACCEPTED.join(" ") + ").");
      return;
    }
    const langs = fileLanguages();
    if (langs.problem) { showFileError(langs.problem); return; }
    forget(current);
    const entry = current = { id: null, name: file.name, target: langs.target, controller: new AbortController(),
                              done: false, url: null };
    $("job-download").classList.add("hidden");
    $("job-download").removeAttribute("href");
    render(entry, { status: "uploading", filename: file.name });
    const form = new FormData();
    form.append("file", file, file.name);
    if (langs.source) form.append("source_lang", langs.source);
    if (langs.target) form.append("target_lang", langs.target);
    let job;
    try {
      job = await page.api("v1/translations/files", { form, signal: entry.controller.signal });
    } catch (err) {
      if (err.name === "AbortError" || entry !== current) return;
      $("job").classList.add("hidden");
      showFileError(err.message);
      return;
    }
    if (entry !== current) return;
    if (!job || !job.id) { showFileError("the server's answer names no job"); return; }
    entry.id = job.id;
    apply(entry, job);
    if (!entry.done) follow(entry);
  }

  async function cancel() {
    const entry = current;
    if (!entry || !entry.id || entry.done) return;
    $("job-cancel").disabled = true;
    try {
      apply(entry, await page.api("v1/translations/jobs/" + encodeURIComponent(entry.id), { method: "DELETE" }));
    } catch (err) {
      showFileError(err.message);
    } finally {
      $("job-cancel").disabled = false;
    }
  }

  // ------------------------------------------------------------------ wiring
  const zone = $("drop-zone");
  $("choose-file").addEventListener("click", () => $("file").click());
  $("file").addEventListener("change", () => {
    const file = $("file").files[0];
    if (file) start(file);
    $("file").value = "";  // the same file chosen again is a new job
  });
  for (const type of ["dragenter", "dragover"]) {
    zone.addEventListener(type, (ev) => { ev.preventDefault(); zone.classList.add("dragging"); });
  }
  zone.addEventListener("dragleave", (ev) => {
    if (!zone.contains(ev.relatedTarget)) zone.classList.remove("dragging");
  });
  zone.addEventListener("drop", (ev) => {
    ev.preventDefault();
    zone.classList.remove("dragging");
    const files = ev.dataTransfer ? ev.dataTransfer.files : null;
    if (files && files.length) start(files[0]);
  });
  // A file dropped beside the zone would otherwise replace the page.
  for (const type of ["dragover", "drop"]) window.addEventListener(type, (ev) => ev.preventDefault());
  $("job-cancel").addEventListener("click", cancel);

  page.files = { start, fileLanguages };
})();
