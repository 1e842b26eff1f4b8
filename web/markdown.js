// A small Markdown subset (paragraphs, fenced code, lists, headings, `code`, **bold**) rendered
// into DOM nodes. Model text only ever reaches the page through textContent / text nodes, so a
// reply containing <script> or <img onerror> is shown as those characters and never parsed as HTML.

const FENCE = /^\s*```/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d+)[.)]\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*)$/;

export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (FENCE.test(line)) {
      const lang = line.trim().slice(3).trim();
      const body = [];
      i += 1;
      while (i < lines.length && !FENCE.test(lines[i])) body.push(lines[i++]);
      i += 1; // closing fence (absent while a reply is still streaming: the block stays open)
      const pre = el("pre");
      const code = el("code", body.join("\n"));
      if (lang) code.dataset.lang = lang;
      pre.append(code);
      frag.append(pre);
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const ordered = !BULLET.test(line);
      const list = el(ordered ? "ol" : "ul");
      const itemRe = ordered ? NUMBERED : BULLET;
      if (ordered) {
        const start = Number(NUMBERED.exec(line)[1]);
        if (start !== 1) list.start = start;
      }
      while (i < lines.length && itemRe.test(lines[i])) {
        const m = itemRe.exec(lines[i]);
        const li = el("li");
        li.append(inline(ordered ? m[2] : m[1]));
        list.append(li);
        i += 1;
      }
      frag.append(list);
    } else if (HEADING.test(line)) {
      const m = HEADING.exec(line);
      const h = el(`h${Math.min(6, m[1].length + 2)}`);
      h.append(inline(m[2]));
      frag.append(h);
      i += 1;
    } else if (line.trim() === "") {
      i += 1;
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i])) para.push(lines[i++]);
      const p = el("p");
      p.append(inline(para.join("\n"))); // newlines kept by CSS white-space: pre-wrap
      frag.append(p);
    }
  }
  return frag;
}

function startsBlock(line) {
  return FENCE.test(line) || BULLET.test(line) || NUMBERED.test(line) || HEADING.test(line);
}

// Inline `code` and **bold**; everything else is a text node.
function inline(text) {
  const frag = document.createDocumentFragment();
  const re = /`([^`\n]+)`|\*\*([^*\n]+)\*\*/g;
  let last = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > last) frag.append(document.createTextNode(text.slice(last, m.index)));
    frag.append(m[1] !== undefined ? el("code", m[1]) : el("strong", m[2]));
    last = m.index + m[0].length;
  }
  if (last < text.length) frag.append(document.createTextNode(text.slice(last)));
  return frag;
}

function el(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  return node;
}
