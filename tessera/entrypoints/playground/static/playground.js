// Tessera playground: chat with the served model through this server's /v1/chat/completions (SSE).
// No framework and no build step. Text from the user or the model only ever goes into the page through
// textContent, never innerHTML.
"use strict";

const $ = (id) => document.getElementById(id);

const els = {
  status: $("status"),
  modelName: $("model-name"),
  messages: $("messages"),
  emptyHint: $("empty-hint"),
  error: $("error"),
  errorText: $("error-text"),
  errorClose: $("error-close"),
  composer: $("composer"),
  attachments: $("attachments"),
  attachLabel: $("attach-label"),
  fileInput: $("file-input"),
  record: $("record"),
  prompt: $("prompt"),
  send: $("send"),
  temperature: $("temperature"),
  temperatureValue: $("temperature-value"),
  maxTokens: $("max-tokens"),
  systemPrompt: $("system-prompt"),
  jsonSchema: $("json-schema"),
  jsonSchemaNote: $("json-schema-note"),
  apiKeyField: $("api-key-field"),
  apiKey: $("api-key"),
  clear: $("clear"),
};

const MEDIA_KINDS = ["image", "video", "audio"];

const state = {
  ready: false,
  model: "default",
  modalities: { image: true, video: false, audio: false }, // replaced by /model_info
  history: [], // OpenAI messages of the conversation so far (the system prompt is added per request)
  pending: [], // attachments of the next message: {kind, name, url} with url a data: URI
  controller: null, // AbortController of the answer being streamed
  recorder: null, // MediaRecorder while the microphone is on
  recordings: 0,
};

// ---- talking to the server --------------------------------------------------------------------

function authHeaders() {
  const key = els.apiKey.value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// The server answers errors in OpenAI's shape, {"error": {"message": ...}}; anything else shows as is.
async function errorMessage(response) {
  const body = await response.text();
  try {
    const message = JSON.parse(body)?.error?.message;
    if (message) return message;
  } catch {
    // not JSON: fall through
  }
  return `${response.status} ${response.statusText}${body ? `: ${body.slice(0, 300)}` : ""}`;
}

async function getJSON(path) {
  const response = await fetch(path, { headers: authHeaders() });
  if (!response.ok) throw new Error(await errorMessage(response));
  return response.json();
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

// /health is 503 "not ready: loading" while the model loads, and names the error if loading failed.
async function waitUntilHealthy() {
  for (;;) {
    const response = await fetch("/health");
    if (response.ok) return;
    const message = await errorMessage(response);
    if (message !== "not ready: loading") throw new Error(message);
    setStatus("loading", "loading the model…");
    await sleep(1000);
  }
}

async function connect() {
  state.ready = false;
  updateSendButton();
  setStatus("loading", "connecting…");
  try {
    const config = await getJSON("/playground/config.json");
    els.apiKeyField.hidden = !config.api_key_required;
    if (config.api_key_required && !els.apiKey.value.trim()) {
      setStatus("error", "API key needed");
      els.apiKey.focus();
      return;
    }
    await waitUntilHealthy();
    applyModelInfo(await getJSON("/model_info"));
    state.ready = true;
    setStatus("ready", "ready");
    hideError();
  } catch (err) {
    setStatus("error", "not connected");
    showError(err.message);
  }
  updateSendButton();
}

function applyModelInfo(info) {
  state.model = info.served_model_name;
  state.modalities = {
    image: info.has_image_understanding,
    video: info.has_video_understanding,
    audio: info.has_audio_understanding,
  };
  els.modelName.textContent = info.served_model_name;
  const kinds = MEDIA_KINDS.filter((kind) => state.modalities[kind]);
  els.fileInput.accept = kinds.map((kind) => `${kind}/*`).join(",");
  els.attachLabel.hidden = kinds.length === 0;
  els.attachLabel.title = kinds.length ? `Attach ${joinWords(kinds.map((k) => `${k}s`))}` : "";
  els.record.hidden = !state.modalities.audio;
  const articles = { image: "an image", video: "a video", audio: "a sound clip" };
  els.prompt.placeholder = kinds.length
    ? `Ask ${info.served_model_name} about ${joinWords(kinds.map((k) => articles[k]))}…`
    : `Message ${info.served_model_name}…`;
}

// Reads the chat completion stream; calls onDelta with each piece of text. Returns the finish reason and
// the usage (asked for with stream_options.include_usage: it comes in the last chunk).
async function streamChat(body, onDelta, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(body),
    signal,
  }).catch((err) => {
    throw err.name === "AbortError" ? err : new Error(`cannot reach the server (${err.message})`);
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const result = { finishReason: null, usage: null };
  for await (const data of serverSentEvents(response.body)) {
    if (data === "[DONE]") return result;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.usage) result.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (choice?.delta?.content) onDelta(choice.delta.content);
    if (choice?.finish_reason) result.finishReason = choice.finish_reason;
  }
  throw new Error("the server closed the stream before the answer was complete (its log may say why)");
}

// Yields the data of each server-sent event (events end with a blank line; data lines are joined).
async function* serverSentEvents(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read().catch((err) => {
        if (err.name === "AbortError") throw err;
        throw new Error(`the connection broke off before the answer was complete (${err.message})`);
      });
      if (done) return;
      buffer += value;
      let end;
      while ((end = /\r?\n\r?\n/.exec(buffer))) {
        const event = buffer.slice(0, end.index);
        buffer = buffer.slice(end.index + end[0].length);
        const data = event
          .split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// ---- sending a message ------------------------------------------------------------------------

function responseFormat() {
  const text = els.jsonSchema.value.trim();
  if (!text) return null;
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (err) {
    throw new Error(`JSON schema: not valid JSON (${err.message})`);
  }
  return { type: "json_schema", json_schema: { name: "playground", schema, strict: true } };
}

function contentPart(att) {
  if (att.kind === "image") return { type: "image_url", image_url: { url: att.url } };
  if (att.kind === "video") return { type: "video_url", video_url: { url: att.url } };
  const mime = att.url.slice(5, att.url.indexOf(";"));
  const format = { "audio/mpeg": "mp3", "audio/x-wav": "wav", "audio/wave": "wav" }[mime] || mime.split("/")[1];
  return { type: "input_audio", input_audio: { data: att.url.slice(att.url.indexOf(",") + 1), format } };
}

async function send() {
  const text = els.prompt.value.trim();
  if (!state.ready || state.controller || (!text && !state.pending.length)) return;
  let format;
  try {
    format = responseFormat();
  } catch (err) {
    showError(err.message);
    return;
  }
  hideError();

  const attachments = state.pending;
  const parts = [...attachments.map(contentPart), ...(text ? [{ type: "text", text }] : [])];
  const userMessage = { role: "user", content: attachments.length ? parts : text };
  const userBubble = appendMessage("user", text, attachments);
  const answer = appendMessage("assistant", "");
  state.pending = [];
  renderAttachments();
  els.prompt.value = "";

  const system = els.systemPrompt.value.trim();
  const body = {
    model: state.model,
    messages: [...(system ? [{ role: "system", content: system }] : []), ...state.history, userMessage],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(els.temperature.value),
  };
  // Empty: the server's default (what fits in the context); anything else goes as typed, the server checks it.
  if (els.maxTokens.value.trim()) body.max_tokens = Number(els.maxTokens.value);
  if (format) body.response_format = format;

  const textEl = answer.querySelector(".text");
  const timing = { start: performance.now(), first: null, end: null };
  let reply = "";
  let deltas = 0;
  state.controller = new AbortController();
  updateSendButton();
  try {
    const result = await streamChat(body, (delta) => {
      timing.first ??= performance.now();
      reply += delta;
      deltas += 1;
      answer.dataset.deltas = String(deltas);
      const follow = isScrolledToBottom();
      textEl.textContent = reply;
      if (follow) scrollToBottom();
    }, state.controller.signal);
    timing.end = performance.now();
    if (format) showAsJSON(textEl, reply);
    showStats(answer, statsLine(result, deltas, timing));
    state.history.push(userMessage, { role: "assistant", content: reply });
  } catch (err) {
    const stopped = err.name === "AbortError";
    if (!reply) {
      // Nothing came back: take the turn out and give the message back for another try.
      userBubble.remove();
      answer.remove();
      els.prompt.value = text;
      state.pending = attachments;
      renderAttachments();
      updateEmptyHint();
      if (!stopped) showError(err.message);
    } else {
      state.history.push(userMessage, { role: "assistant", content: reply });
      showStats(answer, stopped ? "stopped" : "the answer broke off");
      if (!stopped) showError(err.message);
    }
  } finally {
    answer.dataset.done = "true";
    state.controller = null;
    updateSendButton();
  }
}

// Speed is what the browser saw: decode tokens per second between the first and the last token (the
// first token's wait, prefill included, is shown on its own).
function statsLine({ finishReason, usage }, deltas, timing) {
  const tokens = usage?.completion_tokens ?? deltas;
  const parts = [`${tokens} token${tokens === 1 ? "" : "s"}`];
  if (timing.first !== null) {
    const decodeSeconds = (timing.end - timing.first) / 1000;
    if (tokens > 1 && decodeSeconds > 0) parts.push(`${((tokens - 1) / decodeSeconds).toFixed(1)} tok/s`);
    parts.push(`first token ${((timing.first - timing.start) / 1000).toFixed(2)} s`);
  }
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (finishReason === "length") parts.push("stopped at max tokens");
  return parts.join(" · ");
}

function showAsJSON(textEl, reply) {
  try {
    const pretty = JSON.stringify(JSON.parse(reply), null, 2);
    const pre = document.createElement("pre");
    pre.className = "text";
    pre.textContent = pretty;
    textEl.replaceWith(pre);
  } catch {
    // cut off by max tokens or not JSON: leave the text as it came
  }
}

// ---- conversation view ------------------------------------------------------------------------

function appendMessage(role, text, attachments = []) {
  const bubble = document.createElement("div");
  bubble.className = `message ${role}`;
  if (attachments.length) {
    const media = document.createElement("div");
    media.className = "media";
    attachments.forEach((att) => media.append(mediaPreview(att)));
    bubble.append(media);
  }
  if (text || role === "assistant") {
    const textEl = document.createElement("div");
    textEl.className = "text";
    textEl.textContent = text;
    bubble.append(textEl);
  }
  els.messages.append(bubble);
  updateEmptyHint();
  scrollToBottom();
  return bubble;
}

function showStats(bubble, line) {
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = line;
  bubble.append(stats);
}

function mediaPreview(att) {
  if (att.kind === "image") {
    const img = document.createElement("img");
    img.className = "thumb";
    img.src = att.url;
    img.alt = att.name;
    img.title = att.name;
    return img;
  }
  if (att.kind === "video") {
    const video = document.createElement("video");
    video.className = "thumb";
    video.src = att.url;
    video.title = att.name;
    video.muted = true;
    video.loop = true;
    video.autoplay = true;
    video.playsInline = true;
    return video;
  }
  const chip = document.createElement("div");
  chip.className = "audio-chip";
  const name = document.createElement("span");
  name.textContent = att.name;
  const audio = document.createElement("audio");
  audio.src = att.url;
  audio.controls = true;
  chip.append(name, audio);
  return chip;
}

function renderAttachments() {
  els.attachments.replaceChildren(
    ...state.pending.map((att, i) => {
      const item = document.createElement("div");
      item.className = "attachment";
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "remove";
      remove.textContent = "×";
      remove.title = `Remove ${att.name}`;
      remove.addEventListener("click", () => {
        state.pending.splice(i, 1);
        renderAttachments();
      });
      item.append(mediaPreview(att), remove);
      return item;
    }),
  );
}

function clearConversation() {
  state.controller?.abort();
  state.history = [];
  state.pending = [];
  els.messages.replaceChildren(els.emptyHint);
  renderAttachments();
  updateEmptyHint();
  hideError();
  els.prompt.focus();
}

function updateEmptyHint() {
  els.emptyHint.hidden = els.messages.querySelector(".message") !== null;
}

const isScrolledToBottom = () =>
  els.messages.scrollHeight - els.messages.scrollTop - els.messages.clientHeight < 40;
const scrollToBottom = () => {
  els.messages.scrollTop = els.messages.scrollHeight;
};

function setStatus(kind, text) {
  els.status.dataset.state = kind;
  els.status.textContent = text;
}

function showError(message) {
  els.errorText.textContent = message;
  els.error.hidden = false;
}

function hideError() {
  els.error.hidden = true;
}

function updateSendButton() {
  const streaming = state.controller !== null;
  els.send.textContent = streaming ? "Stop" : "Send";
  els.send.classList.toggle("stop", streaming);
  els.send.disabled = !state.ready;
}

const joinWords = (words) =>
  words.length < 2 ? words.join("") : `${words.slice(0, -1).join(", ")} or ${words[words.length - 1]}`;

// ---- attachments: files, drag and drop, paste, microphone -------------------------------------

function readAsDataURL(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

async function addFiles(files) {
  for (const file of files) {
    const kind = MEDIA_KINDS.find((k) => file.type.startsWith(`${k}/`));
    if (!kind) {
      showError(`${file.name}: not an image, video or audio file`);
      continue;
    }
    if (!state.modalities[kind]) {
      showError(`${file.name}: ${state.model} does not take ${kind} input`);
      continue;
    }
    state.pending.push({ kind, name: file.name, url: await readAsDataURL(file) });
  }
  renderAttachments();
}

async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  if (!navigator.mediaDevices?.getUserMedia) {
    showError("The microphone needs a secure page: open the playground on localhost or over https.");
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (err) {
    showError(`Microphone: ${err.message}`);
    return;
  }
  const recorder = new MediaRecorder(stream);
  const chunks = [];
  recorder.addEventListener("dataavailable", (e) => chunks.push(e.data));
  recorder.addEventListener("stop", async () => {
    stream.getTracks().forEach((track) => track.stop());
    state.recorder = null;
    setRecording(false);
    try {
      const wav = await toWav(new Blob(chunks, { type: recorder.mimeType }));
      state.recordings += 1;
      state.pending.push({ kind: "audio", name: `recording ${state.recordings}.wav`, url: await readAsDataURL(wav) });
      renderAttachments();
    } catch (err) {
      showError(`Could not decode the recording: ${err.message}`);
    }
  });
  recorder.start();
  state.recorder = recorder;
  setRecording(true);
}

function setRecording(on) {
  els.record.classList.toggle("recording", on);
  els.record.title = on ? "Stop recording" : "Record from the microphone";
}

// MediaRecorder makes WebM/Opus (Chromium, Firefox) or MP4/AAC (Safari). The recording is decoded here and
// sent as 16 kHz mono 16-bit WAV: the format OpenAI's input_audio names, and the rate speech models use.
async function toWav(blob) {
  const context = new AudioContext({ sampleRate: 16000 });
  try {
    const audio = await context.decodeAudioData(await blob.arrayBuffer());
    const mono = new Float32Array(audio.length);
    for (let c = 0; c < audio.numberOfChannels; c++) {
      audio.getChannelData(c).forEach((v, i) => (mono[i] += v / audio.numberOfChannels));
    }
    return encodeWav(mono, audio.sampleRate);
  } finally {
    context.close();
  }
}

function encodeWav(samples, rate) {
  const view = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const ascii = (offset, text) => [...text].forEach((ch, i) => view.setUint8(offset + i, ch.charCodeAt(0)));
  ascii(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  ascii(8, "WAVE");
  ascii(12, "fmt ");
  view.setUint32(16, 16, true); // size of the fmt chunk
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true); // bytes per second
  view.setUint16(32, 2, true); // bytes per frame
  view.setUint16(34, 16, true); // bits per sample
  ascii(36, "data");
  view.setUint32(40, samples.length * 2, true);
  samples.forEach((v, i) => view.setInt16(44 + i * 2, Math.max(-1, Math.min(1, v)) * 0x7fff, true));
  return new Blob([view], { type: "audio/wav" });
}

// ---- wiring -----------------------------------------------------------------------------------

function checkSchemaBox() {
  let message = "When set, answers are constrained to this schema.";
  let invalid = false;
  try {
    responseFormat();
  } catch (err) {
    message = err.message;
    invalid = true;
  }
  els.jsonSchema.classList.toggle("invalid", invalid);
  els.jsonSchemaNote.classList.toggle("invalid", invalid);
  els.jsonSchemaNote.textContent = message;
}

function wire() {
  els.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    if (state.controller) state.controller.abort();
    else send();
  });
  els.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      if (!state.controller) send();
    }
  });
  els.prompt.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData?.files ?? [])];
    if (files.length) {
      e.preventDefault();
      addFiles(files);
    }
  });
  els.fileInput.addEventListener("change", async () => {
    await addFiles([...els.fileInput.files]);
    els.fileInput.value = ""; // the same file can be attached again
  });
  els.record.addEventListener("click", toggleRecording);
  els.clear.addEventListener("click", clearConversation);
  els.errorClose.addEventListener("click", hideError);
  els.temperature.addEventListener("input", () => {
    els.temperatureValue.textContent = Number(els.temperature.value).toFixed(2);
  });
  els.temperatureValue.textContent = Number(els.temperature.value).toFixed(2);
  els.jsonSchema.addEventListener("input", checkSchemaBox);

  els.apiKey.value = sessionStorage.getItem("tessera-api-key") ?? "";
  els.apiKeyField.addEventListener("submit", (e) => e.preventDefault()); // Enter fires "change" below
  els.apiKey.addEventListener("change", () => {
    sessionStorage.setItem("tessera-api-key", els.apiKey.value.trim());
    connect();
  });

  document.addEventListener("dragover", (e) => {
    if (!e.dataTransfer?.types.includes("Files")) return;
    e.preventDefault();
    document.body.classList.add("dragging");
  });
  document.addEventListener("dragleave", (e) => {
    if (e.relatedTarget === null) document.body.classList.remove("dragging");
  });
  document.addEventListener("drop", (e) => {
    if (!e.dataTransfer?.files.length) return;
    e.preventDefault();
    document.body.classList.remove("dragging");
    addFiles([...e.dataTransfer.files]);
  });
}

wire();
connect();
