// The feedsvc console: one queue's stats, newest messages and live tail, and
// a form to post. Plain JavaScript, no build step, nothing loaded from
// elsewhere: the page talks to the service that served it and to nothing else.
//
// Why the live tail reads the stream with fetch() and not EventSource:
// every /v2 request needs headers (Client-ID, X-Project-ID, and with
// --auth-token an Authorization bearer token), and EventSource cannot send
// headers. Putting them in the URL would leak the token into logs and
// history. So the tail is a fetch() with `Accept: text/event-stream`, read
// through the response body's ReadableStream and parsed here (SseParser,
// the framing of the HTML standard's event stream: lines, `id:`, `event:`,
// `data:`, `retry:`, `:` comments, a blank line ends an event). What
// EventSource would do for us is done by LiveTail: it remembers the id of
// the last event it showed, and after a drop (network error, server restart,
// the server's own close at the end of a connection's lifetime) it connects
// again after a short back-off with `Last-Event-ID: <that id>`, so the
// service resumes right after it: no gap, no repeat. It does not reconnect
// after `event: end` (the queue was deleted) or a 4xx answer.
"use strict";

(() => {
  const PAGE_LIMIT = 20; // the service's default maximum page size
  const MAX_PAGES = 10; // pages followed from the newest messages to the tail (a bound: ~4 needed)
  const MAX_QUEUE_PAGES = 50; // pages of queues listed (1,000 queues)
  const SHOWN_MESSAGES = 50; // newest messages kept in the list
  const SHOWN_EVENTS = 200; // newest tail events kept on the page
  const STATS_CONCURRENCY = 4; // stats requests in flight while listing queues
  const RETRY_MS = 1000; // first back-off, until the server sends `retry:`
  const MAX_BACKOFF_MS = 10000;
  // A stream that sends nothing (not even a heartbeat comment) for this long
  // is taken as dropped: three of the service's default 15 s heartbeats.
  const SILENCE_MS = 45000;

  const STORAGE = {
    client: "feedsvc.console.client-id",
    token: "feedsvc.console.token",
  };

  const $ = (id) => document.getElementById(id);

  // -- identity and headers -------------------------------------------------

  // crypto.randomUUID exists in secure contexts only; getRandomValues
  // everywhere, so a console served over plain http on a LAN address works.
  function uuid4() {
    const b = crypto.getRandomValues(new Uint8Array(16));
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
    return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
  }

  // One Client-ID per tab: kept in sessionStorage, so a reload keeps it and
  // another tab gets its own. The token stays in sessionStorage only (gone
  // when the tab closes, never in the URL or localStorage).
  function clientId() {
    let id = sessionStorage.getItem(STORAGE.client);
    if (!id) {
      id = uuid4();
      sessionStorage.setItem(STORAGE.client, id);
    }
    return id;
  }

  function apiHeaders() {
    const headers = { "Client-ID": clientId(), "X-Project-ID": state.project };
    const token = sessionStorage.getItem(STORAGE.token);
    if (token) headers.Authorization = `Bearer ${token}`;
    return headers;
  }

  class ApiError extends Error {
    constructor(status, title, description) {
      super(`${status} ${title}: ${description}`);
      this.status = status;
      this.title = title;
      this.description = description;
    }
  }

  // JSON.parse, but a number that a double cannot hold as written (an integer
  // beyond 2**53, "1.0") keeps its source text, so the page shows bodies
  // exactly as stored (JSON.parse's source text access and JSON.rawJSON;
  // a browser without them rounds such numbers, for display only).
  const exactNumbers = typeof JSON.rawJSON === "function";
  function parseExact(text) {
    if (!exactNumbers) return JSON.parse(text);
    return JSON.parse(text, (key, value, context) =>
      typeof value === "number" && context && context.source !== String(value)
        ? JSON.rawJSON(context.source)
        : value,
    );
  }

  function showJson(value) {
    const line = JSON.stringify(value);
    return line.length <= 100 ? line : JSON.stringify(value, null, 2);
  }

  async function errorOf(response) {
    let title = response.statusText;
    let description = "";
    try {
      const payload = await response.json();
      title = payload.title || title;
      description = payload.description || "";
    } catch (_) {
      // not the service's JSON error: keep the status line
    }
    return new ApiError(response.status, title, description);
  }

  // A /v2 request; the decoded JSON (null for 204), or an ApiError. options.body:
  // JSON text to send; options.withGap: answer {payload, gap} with X-Gap (gapOf).
  async function api(path, options = {}) {
    const headers = apiHeaders();
    const body = options.body;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method: options.method || "GET",
      headers,
      body,
      cache: "no-store",
    });
    if (!response.ok) throw await errorOf(response);
    if (response.status === 204) return null;
    const payload = parseExact(await response.text());
    if (options.withGap) return { payload, gap: gapOf(response.headers.get("X-Gap")) };
    return payload;
  }

  // `X-Gap: missed=N; first=M` (docs/live-following.md) as {missed, first};
  // null without one.
  function gapOf(header) {
    if (!header) return null;
    const fields = Object.fromEntries(
      header.split(";").map((part) => part.trim().split("=", 2)).filter((kv) => kv.length === 2),
    );
    const missed = Number(fields.missed);
    return missed > 0 ? { missed, first: fields.first || "" } : null;
  }

  const queuePath = (queue) => `/v2/queues/${encodeURIComponent(queue)}`;

  function nextHref(page) {
    const link = (page.links || []).find((l) => l.rel === "next");
    return link ? link.href : null;
  }

  function markerOf(href) {
    return new URL(href, location.origin).searchParams.get("marker");
  }

  // -- page state -------------------------------------------------------------

  const state = { project: "", queue: "", tail: null };

  function say(text, isError = false) {
    const status = $("status");
    status.textContent = text;
    status.classList.toggle("error", isError);
  }

  function explain(error) {
    if (error instanceof ApiError) {
      if (error.status === 401) {
        $("token").focus();
        return "401: this service needs a token (--auth-token); enter it above.";
      }
      return error.message;
    }
    return `the service could not be reached (${error.message})`;
  }

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text; // never innerHTML: bodies are data
    return node;
  }

  // One message as a list item: data-id carries its id (the tests read it).
  function messageItem(message, marker) {
    const item = element("li", "message");
    item.dataset.id = message.id;
    if (marker) item.dataset.marker = marker;
    const meta = element("div", "meta");
    meta.append(
      element("code", "id", message.id),
      element("span", "", ` · age ${message.age} s · ttl ${message.ttl} s`),
    );
    item.append(meta, element("pre", "body", showJson(message.body)));
    return item;
  }

  // What the service said was gone unseen (expired, deleted, popped, moved)
  // before the next message shown: a line of its own, never papered over.
  function gapItem(gap) {
    const item = element("li", "gap");
    item.dataset.missed = String(gap.missed);
    if (gap.first) item.dataset.first = gap.first;
    const plural = gap.missed === 1 ? "message" : "messages";
    item.append(element("span", "", `gap: ${gap.missed} ${plural} expired or deleted, never shown here`));
    return item;
  }

  // -- queues and their stats -------------------------------------------------

  async function loadQueues() {
    if (!state.project) return;
    const tbody = $("queues").tBodies[0];
    const note = $("queues-note");
    note.textContent = "loading…";
    const names = [];
    let href = `/v2/queues?detailed=true&limit=${PAGE_LIMIT}`;
    let pages = 0;
    try {
      while (href && pages < MAX_QUEUE_PAGES) {
        const page = await api(href);
        pages += 1;
        if (!page.queues.length) break;
        names.push(...page.queues.map((q) => q.name));
        href = nextHref(page);
      }
    } catch (error) {
      note.textContent = "";
      say(explain(error), true);
      return;
    }
    tbody.replaceChildren();
    const rows = new Map();
    for (const name of names) {
      const row = element("tr");
      row.dataset.queue = name;
      row.tabIndex = 0;
      row.classList.toggle("selected", name === state.queue);
      const link = element("td", "name", name);
      row.append(link, element("td", "total"), element("td", "free"), element("td", "claimed"),
        element("td", "newest"));
      row.addEventListener("click", () => openQueue(name));
      row.addEventListener("keydown", (e) => { if (e.key === "Enter") openQueue(name); });
      tbody.append(row);
      rows.set(name, row);
    }
    note.textContent = names.length
      ? (pages >= MAX_QUEUE_PAGES && href ? `the first ${names.length} queues` : "")
      : "no queues in this project yet: post a message to create one";
    // stats: a few requests at a time
    const pending = [...names];
    const worker = async () => {
      while (pending.length) {
        const name = pending.shift();
        await loadStats(name, rows.get(name));
      }
    };
    await Promise.all(Array.from({ length: STATS_CONCURRENCY }, worker));
  }

  async function loadStats(name, row) {
    if (!row) return;
    try {
      const { messages } = await api(`${queuePath(name)}/stats`);
      for (const key of ["total", "free", "claimed"]) {
        row.querySelector(`.${key}`).textContent = String(messages[key]);
      }
      row.querySelector(".newest").textContent = messages.newest ? String(messages.newest.age) : "";
    } catch (error) {
      row.querySelector(".total").textContent = "?";
      row.title = explain(error);
    }
  }

  let statsTimer = null;
  // A tail event or a post changes the chosen queue's stats: refresh them,
  // at most once a second.
  function refreshStatsSoon() {
    if (statsTimer) return;
    statsTimer = setTimeout(() => {
      statsTimer = null;
      const row = [...$("queues").tBodies[0].rows].find((r) => r.dataset.queue === state.queue);
      if (row) loadStats(state.queue, row);
      else loadQueues();
    }, 1000);
  }

  // -- the newest messages ------------------------------------------------------

  // Pages run oldest to newest. `from=tail` answers at once with a link
  // carrying the queue's last marker; markers count a queue's messages one by
  // one (docs/live-following.md), so the newest SHOWN_MESSAGES were posted
  // after that marker less SHOWN_MESSAGES: list from there to the end (a few
  // pages, not the whole queue). Returns the marker after the last message
  // seen, where the live tail starts.
  async function loadMessages() {
    const queue = state.queue;
    const list = $("messages");
    const note = $("messages-note");
    note.textContent = "loading…";
    const kept = [];
    let marker = null;
    let limit = PAGE_LIMIT;
    const filters = "echo=true&include_claimed=true";
    let href = null;
    let pages = 0;
    try {
      for (;;) {
        try {
          const tail = await api(`${queuePath(queue)}/messages?from=tail&${filters}${limit ? `&limit=${limit}` : ""}`);
          const last = BigInt(markerOf(nextHref(tail)));
          const from = last > BigInt(SHOWN_MESSAGES) ? last - BigInt(SHOWN_MESSAGES) : 0n;
          href = `${queuePath(queue)}/messages?marker=${from}&${filters}${limit ? `&limit=${limit}` : ""}`;
          marker = String(from); // where the live tail starts if nothing is listed
          break;
        } catch (error) {
          // a service configured with a smaller --max-messages-per-page
          if (error instanceof ApiError && error.status === 400 && limit) {
            limit = 0;
            continue;
          }
          throw error;
        }
      }
      if (queue !== state.queue) return null; // another queue was chosen meanwhile
      while (href && pages < MAX_PAGES) {
        const { payload: page, gap } = await api(href, { withGap: true });
        pages += 1;
        if (queue !== state.queue) return null; // another queue was chosen meanwhile
        if (gap) kept.push({ gap });
        kept.push(...page.messages);
        kept.splice(0, Math.max(0, kept.length - SHOWN_MESSAGES));
        href = page.messages.length ? nextHref(page) : null;
        if (href) marker = markerOf(href);
      }
    } catch (error) {
      note.textContent = "";
      say(explain(error), true);
      return null;
    }
    list.replaceChildren(...kept.map((m) => (m.gap ? gapItem(m.gap) : messageItem(m))));
    list.scrollTop = list.scrollHeight;
    const shown = kept.filter((m) => !m.gap).length;
    if (href) {
      note.textContent = `the newest ${shown}, and more keep coming (the live tail shows them)`;
    } else {
      note.textContent = shown
        ? `the newest ${shown}`
        : "no messages (the live tail shows new ones as they come)";
    }
    return { marker };
  }

  // -- the live tail ----------------------------------------------------------------

  // The framing of text/event-stream (HTML standard, "Interpreting an event
  // stream"). feed() takes decoded text in pieces of any size; onEvent gets
  // {type, data, id} per dispatched event, onRetry the `retry:` milliseconds,
  // onComment each `:` line (heartbeats).
  class SseParser {
    constructor({ onEvent, onRetry, onComment }) {
      this.onEvent = onEvent;
      this.onRetry = onRetry;
      this.onComment = onComment;
      this.buffer = "";
      this.skipLF = false; // the last piece ended in CR: a LF right after it is that line's end
      this.started = false;
      this.lastEventId = "";
      this.resetEvent();
    }

    resetEvent() {
      this.data = "";
      this.type = "";
      this.idBuffer = this.lastEventId;
    }

    feed(text) {
      if (!this.started && text) {
        this.started = true;
        if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
      }
      if (this.skipLF && text.startsWith("\n")) text = text.slice(1);
      this.skipLF = false;
      this.buffer += text;
      let start = 0;
      for (;;) {
        const cr = this.buffer.indexOf("\r", start);
        const lf = this.buffer.indexOf("\n", start);
        if (cr < 0 && lf < 0) break;
        let end;
        let next;
        if (cr >= 0 && (lf < 0 || cr < lf)) {
          end = cr;
          if (cr + 1 < this.buffer.length) {
            next = this.buffer[cr + 1] === "\n" ? cr + 2 : cr + 1;
          } else {
            next = cr + 1;
            this.skipLF = true; // CRLF may be split across pieces
          }
        } else {
          end = lf;
          next = lf + 1;
        }
        this.line(this.buffer.slice(start, end));
        start = next;
      }
      this.buffer = this.buffer.slice(start);
    }

    line(line) {
      if (line === "") {
        this.dispatch();
        return;
      }
      if (line.startsWith(":")) {
        this.onComment(line.slice(1));
        return;
      }
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "event") this.type = value;
      else if (field === "data") this.data += `${value}\n`;
      else if (field === "id") {
        if (!value.includes("\0")) this.idBuffer = value;
      } else if (field === "retry") {
        if (/^\d+$/.test(value)) this.onRetry(Number(value));
      }
    }

    dispatch() {
      this.lastEventId = this.idBuffer;
      if (this.data === "") {
        this.resetEvent();
        return;
      }
      const event = { type: this.type || "message", data: this.data.slice(0, -1), id: this.lastEventId };
      this.resetEvent();
      this.onEvent(event);
    }
  }

  class LiveTail {
    constructor(queue, startMarker) {
      this.queue = queue;
      this.startMarker = startMarker; // where the list ended: the tail starts after it
      this.lastId = ""; // id of the last event shown: Last-Event-ID of the next connection
      this.retryMs = RETRY_MS;
      this.failures = 0;
      this.count = 0;
      this.reconnects = 0;
      this.running = false;
      this.controller = null;
      this.timer = null;
      this.list = $("tail");
    }

    setState(name, text) {
      const node = $("tail-state");
      node.dataset.state = name;
      node.textContent = text || name;
    }

    start() {
      if (this.running) return;
      this.running = true;
      $("tail-toggle").disabled = false;
      $("tail-toggle").textContent = "Pause";
      this.connect();
    }

    stop(name = "paused", text) {
      this.running = false;
      clearTimeout(this.timer);
      if (this.controller) this.controller.abort();
      this.controller = null;
      this.setState(name, text);
      $("tail-toggle").textContent = "Resume";
    }

    async connect() {
      const controller = new AbortController();
      this.controller = controller;
      const headers = apiHeaders();
      headers.Accept = "text/event-stream";
      let url = `${queuePath(this.queue)}/messages?echo=true&include_claimed=true`;
      // Last-Event-ID wins over marker at the service; send just one of them
      if (this.lastId) headers["Last-Event-ID"] = this.lastId;
      else if (this.startMarker) url += `&marker=${encodeURIComponent(this.startMarker)}`;
      else url += "&from=tail"; // no list to start after: new messages only
      this.setState("connecting", this.reconnects ? "reconnecting" : "connecting");
      let silence = null;
      const watchdog = () => {
        clearTimeout(silence);
        silence = setTimeout(() => controller.abort(new Error("silent stream")), SILENCE_MS);
      };
      let retryAfterMs = null;
      try {
        watchdog();
        const response = await fetch(url, { headers, signal: controller.signal, cache: "no-store" });
        if (!response.ok) {
          const error = await errorOf(response);
          const transient = response.status >= 500 || response.status === 408 || response.status === 429;
          if (!transient) {
            this.stop("error", explain(error));
            return;
          }
          const after = Number(response.headers.get("Retry-After"));
          if (after > 0) retryAfterMs = after * 1000;
          throw error;
        }
        const type = response.headers.get("Content-Type") || "";
        if (!type.startsWith("text/event-stream")) {
          controller.abort();
          this.stop("error", `no live stream here: the service answered ${type || "no Content-Type"}`);
          return;
        }
        this.failures = 0;
        this.setState("live");
        let ended = false;
        const parser = new SseParser({
          onEvent: (event) => {
            if (event.type === "message") this.show(event);
            else if (event.type === "gap") this.showGap(event);
            else if (event.type === "end") ended = true;
          },
          onRetry: (ms) => { this.retryMs = ms; },
          onComment: () => {},
        });
        parser.lastEventId = this.lastId;
        parser.resetEvent();
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          watchdog();
          parser.feed(decoder.decode(value, { stream: true }));
          if (ended) break;
        }
        if (ended) {
          controller.abort();
          this.stop("ended", "ended: the queue was deleted");
          $("tail-toggle").disabled = true; // choose the queue again to follow a new one
          loadQueues();
          return;
        }
        // the server closed the stream (its connection lifetime, a restart):
        // resume after the server's `retry:` time, as EventSource would
      } catch (error) {
        if (!this.running || this.controller !== controller) return; // stopped on purpose
        this.failures += 1;
      } finally {
        clearTimeout(silence);
      }
      if (!this.running || this.controller !== controller) return;
      const backoff = retryAfterMs || Math.min(MAX_BACKOFF_MS, this.retryMs * 2 ** Math.max(0, this.failures - 1));
      const delay = this.failures ? Math.round(backoff * (0.8 + 0.4 * Math.random())) : this.retryMs;
      this.setState("waiting", `reconnecting in ${(delay / 1000).toFixed(1)} s`);
      this.timer = setTimeout(() => {
        if (!this.running) return;
        this.reconnects += 1;
        $("tail-reconnects").textContent = String(this.reconnects);
        this.connect();
      }, delay);
    }

    // `event: gap` with {"missed": N, "first": M}: what expired or was
    // deleted since the last event shown, told just before event M.
    showGap(event) {
      let gap;
      try {
        gap = JSON.parse(event.data);
      } catch (_) {
        return;
      }
      if (!(gap.missed > 0)) return;
      this.append(gapItem({ missed: gap.missed, first: String(gap.first || "") }));
    }

    append(item) {
      const atBottom = this.list.scrollHeight - this.list.scrollTop - this.list.clientHeight < 40;
      this.list.append(item);
      while (this.list.children.length > SHOWN_EVENTS) this.list.firstElementChild.remove();
      if (atBottom) this.list.scrollTop = this.list.scrollHeight;
    }

    show(event) {
      let message;
      try {
        message = parseExact(event.data);
      } catch (_) {
        message = { id: event.id, age: "?", ttl: "?", body: event.data };
      }
      this.lastId = event.id;
      this.count += 1;
      $("tail-count").textContent = String(this.count);
      $("tail-last-id").textContent = event.id || "-";
      this.append(messageItem(message, event.id));
      refreshStatsSoon();
    }
  }

  // -- choosing the project and queue ---------------------------------------------------

  function updateLocation() {
    const params = new URLSearchParams();
    if (state.project) params.set("project", state.project);
    if (state.queue) params.set("queue", state.queue);
    const query = params.toString();
    history.replaceState(null, "", query ? `${location.pathname}?${query}` : location.pathname);
  }

  async function openQueue(name) {
    if (state.tail) state.tail.stop("idle");
    state.tail = null;
    state.queue = name;
    $("queue").value = name;
    updateLocation();
    $("messages-queue").textContent = name;
    $("tail").replaceChildren();
    $("tail-count").textContent = "0";
    $("tail-reconnects").textContent = "0";
    $("tail-last-id").textContent = "-";
    for (const row of $("queues").tBodies[0].rows) {
      row.classList.toggle("selected", row.dataset.queue === name);
    }
    const loaded = await loadMessages();
    if (!loaded || state.queue !== name) return;
    state.tail = new LiveTail(name, loaded.marker);
    state.tail.start();
  }

  async function openTarget() {
    const project = $("project").value.trim();
    const queue = $("queue").value.trim();
    if (!project) {
      say("Choose a project (X-Project-ID).", true);
      return;
    }
    const changed = project !== state.project;
    state.project = project;
    say(`project ${project} · Client-ID ${clientId()}`);
    if (changed) {
      if (state.tail) state.tail.stop("idle");
      state.tail = null;
      state.queue = "";
    }
    updateLocation();
    const listing = loadQueues();
    if (queue && (queue !== state.queue || !state.tail)) await openQueue(queue);
    await listing;
  }

  // -- posting ------------------------------------------------------------------------

  async function postMessage() {
    const result = $("post-result");
    result.classList.remove("error");
    const fail = (text) => {
      result.textContent = text;
      result.dataset.status = "error";
      result.classList.add("error");
    };
    if (!state.project || !state.queue) {
      fail("Choose a project and a queue first.");
      return;
    }
    // The body goes out as typed (checked, not re-encoded: JSON.stringify
    // would round big integers).
    const text = $("post-body").value.trim();
    try {
      JSON.parse(text);
    } catch (error) {
      fail(`The body is not JSON: ${error.message}`);
      return;
    }
    const ttl = $("post-ttl").value.trim();
    if (ttl && !/^\d+$/.test(ttl)) {
      fail("The TTL is a whole number of seconds.");
      return;
    }
    const message = `{"body": ${text}${ttl ? `, "ttl": ${ttl}` : ""}}`;
    result.dataset.status = "posting";
    result.textContent = "posting…";
    try {
      const answer = await api(`${queuePath(state.queue)}/messages`, {
        method: "POST",
        body: `{"messages": [${message}]}`,
      });
      result.dataset.status = "posted";
      result.textContent = `posted ${answer.resources.join(", ")}`;
      refreshStatsSoon();
    } catch (error) {
      fail(explain(error));
    }
  }

  // -- wiring ---------------------------------------------------------------------------

  function init() {
    const params = new URLSearchParams(location.search);
    $("project").value = params.get("project") || "";
    $("queue").value = params.get("queue") || "";
    $("token").value = sessionStorage.getItem(STORAGE.token) || "";
    $("token").addEventListener("change", () => {
      const token = $("token").value.trim();
      if (token) sessionStorage.setItem(STORAGE.token, token);
      else sessionStorage.removeItem(STORAGE.token);
    });
    $("target").addEventListener("submit", (e) => {
      e.preventDefault();
      $("token").dispatchEvent(new Event("change"));
      openTarget();
    });
    $("refresh-queues").addEventListener("click", () => loadQueues());
    $("refresh-messages").addEventListener("click", () => {
      if (state.queue) loadMessages();
    });
    $("tail-toggle").addEventListener("click", () => {
      if (!state.tail) return;
      if (state.tail.running) state.tail.stop();
      else state.tail.start();
    });
    $("post").addEventListener("submit", (e) => {
      e.preventDefault();
      postMessage();
    });
    if ($("project").value) openTarget();
    else say("Choose a project, then a queue.");
  }

  // for tests/test_console.py, which checks the parser in the browser
  window.feedsvcConsole = { SseParser };
  init();
})();
