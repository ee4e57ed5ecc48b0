// The chat page's script: log in with an API key, pick a model from /oai/v1/models, and chat
// through /oai/v1/chat/completions, reading the server-sent events as they arrive.
//
// The key lives in sessionStorage (this tab only) and travels only in the Authorization header,
// never in a URL. Everything the server or the model wrote is shown with textContent, never
// parsed as HTML.
"use strict";

(() => {
  const KEY_ITEM = "treadle.apiKey";
  const api = document.body.dataset.api;
  const $ = (id) => document.getElementById(id);
  const conversation = [];
  let busy = false;

  function headers(key) {
    return { Authorization: `Bearer ${key}`, "Content-Type": "application/json" };
  }

  // The server's own words for a refused request: OpenAI's {"error": {"message"}} under /oai,
  // Treadle's {"detail"} elsewhere.
  async function errorText(response) {
    const text = await response.text();
    try {
      const body = JSON.parse(text);
      const message = (body.error && body.error.message) || body.detail;
      if (message) return `${response.status}: ${message}`;
    } catch (_) {
      // not JSON: show it as it came
    }
    return `${response.status}: ${text || response.statusText}`;
  }

  // Live runs first, then your checkpoints, references and sampling sessions, then base models.
  function rank(model) {
    if (model.id.startsWith("live:")) return 0;
    return model.owned_by === "treadle" ? 2 : 1;
  }
  const GROUPS = ["Live training runs", "Checkpoints and sessions", "Base models"];

  function showModels(models) {
    const select = $("models");
    const previous = select.value;
    select.replaceChildren();
    const groups = GROUPS.map((label) => {
      const group = document.createElement("optgroup");
      group.label = label;
      return group;
    });
    for (const model of models) {
      const option = document.createElement("option");
      option.value = model.id;
      option.textContent = model.id;
      groups[rank(model)].append(option);
    }
    for (const group of groups) if (group.children.length) select.append(group);
    if (previous && [...select.options].some((o) => o.value === previous)) select.value = previous;
  }

  async function logIn(key) {
    $("login-error").textContent = "";
    let response;
    try {
      response = await fetch(`${api}/models`, { headers: headers(key) });
    } catch (error) {
      $("login-error").textContent = `The server did not answer: ${error}`;
      return false;
    }
    if (!response.ok) {
      $("login-error").textContent = await errorText(response);
      return false;
    }
    sessionStorage.setItem(KEY_ITEM, key);
    showModels((await response.json()).data);
    $("login-panel").hidden = true;
    $("chat-panel").hidden = false;
    $("logout").hidden = false;
    return true;
  }

  function logOut() {
    sessionStorage.removeItem(KEY_ITEM);
    $("key").value = "";
    $("chat-panel").hidden = true;
    $("logout").hidden = true;
    $("login-panel").hidden = false;
    newChat();
  }

  function newChat() {
    conversation.length = 0;
    $("transcript").replaceChildren();
    $("finish").textContent = "";
    $("usage").textContent = "";
    $("chat-error").textContent = "";
  }

  function bubble(role, text) {
    const item = document.createElement("li");
    item.className = role;
    item.textContent = text;
    $("transcript").append(item);
    return item;
  }

  // Server-sent events: blocks separated by a blank line, each `data: <json>` or `data: [DONE]`.
  async function* events(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffered += decoder.decode(value || new Uint8Array(), { stream: !done });
      let end;
      while ((end = buffered.indexOf("\n\n")) >= 0) {
        const block = buffered.slice(0, end);
        buffered = buffered.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
      if (done) return;
    }
  }

  async function send(text) {
    const key = sessionStorage.getItem(KEY_ITEM);
    if (!key) return logOut();
    $("chat-error").textContent = "";
    $("finish").textContent = "";
    $("usage").textContent = "";
    const request = {
      model: $("models").value,
      messages: [...conversation, { role: "user", content: text }],
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number($("temperature").value),
      max_tokens: Number($("max-tokens").value),
    };
    const asked = bubble("user", text);
    let response;
    try {
      response = await fetch(`${api}/chat/completions`, {
        method: "POST",
        headers: headers(key),
        body: JSON.stringify(request),
      });
    } catch (error) {
      response = null;
      $("chat-error").textContent = `The server did not answer: ${error}`;
    }
    if (!response || !response.ok) {
      // A refused message is not part of the conversation: it stays in the box to fix and resend.
      if (response) $("chat-error").textContent = await errorText(response);
      asked.remove();
      return false;
    }
    const answer = bubble("assistant streaming", "");
    let reply = "";
    try {
      for await (const chunk of events(response.body)) {
        // A failure after the stream started arrives as an event in OpenAI's error format.
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          if (choice.index !== 0) continue;
          const piece = choice.delta && choice.delta.content;
          if (piece) {
            reply += piece;
            answer.append(piece);
          }
          if (choice.finish_reason) $("finish").textContent = `finish: ${choice.finish_reason}`;
        }
        if (chunk.usage) {
          const u = chunk.usage;
          $("usage").textContent =
            `usage: ${u.prompt_tokens} prompt + ${u.completion_tokens} completion = ` +
            `${u.total_tokens} tokens`;
        }
      }
    } catch (error) {
      $("chat-error").textContent = `The answer was cut off: ${error}`;
    }
    answer.classList.remove("streaming");
    conversation.push({ role: "user", content: text }, { role: "assistant", content: reply });
    return true;
  }

  $("login").addEventListener("submit", async (event) => {
    event.preventDefault();
    await logIn($("key").value.trim());
  });
  $("logout").addEventListener("click", logOut);
  $("clear").addEventListener("click", newChat);
  $("refresh").addEventListener("click", async () => {
    const key = sessionStorage.getItem(KEY_ITEM);
    if (key) await logIn(key);
  });
  $("settings").addEventListener("submit", (event) => event.preventDefault());
  $("compose").addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = $("message").value;
    if (busy || !text.trim() || !$("models").value) return;
    busy = true;
    $("send").disabled = true;
    try {
      $("message").value = "";
      if (!(await send(text))) $("message").value = text;
    } finally {
      busy = false;
      $("send").disabled = false;
    }
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("compose").requestSubmit();
    }
  });

  const saved = sessionStorage.getItem(KEY_ITEM);
  if (saved) {
    logIn(saved).then((ok) => {
      if (!ok) sessionStorage.removeItem(KEY_ITEM);
    });
  }
})();
