"""Markdown (CommonMark with GFM tables and strikethrough, read by markdown-it-py).

Only inline content is translated: paragraphs, headings, list items, block quotes and table cells. Code
blocks, fenced code, HTML blocks, thematic breaks, link reference definitions and every character outside the
translated inline content stay as they are. Inside it, emphasis, strong emphasis, strikethrough and links are
groups (their markers and the link's destination and title written again around the target words aligned
to their text); inline code, images, autolinks, inline HTML and hard breaks are pieces kept whole. A soft
line break reads as a space, so a paragraph's translation is one line (its container's prefix is kept on
the first). Translated text escapes the characters Markdown would read as syntax; reference links come back
as inline links to the same destination."""

from __future__ import annotations

import re

from markdown_it import MarkdownIt

from tserve.model.html_markup import VOID_TAGS, Markup
from tserve.service.translation.files.containers import FileRefused
from tserve.service.translation.files.inline import (
    Group,
    Node,
    Paragraph,
    Piece,
    from_rendered,
    no_escape,
    to_block,
)
from tserve.service.translation.files.text_files import charset, decode_text, encoded
from tserve.service.translation.files.xml_parts import FileDocument

_SYNTAX = re.compile(r"([\\`*_\[\]<])")
_OPEN_TAG = re.compile(r"<([A-Za-z][\w-]*)(?:\s[^<>]*[^/<>])?>")  # not self-closing: <br/> ends in "/>"
_PAIRS = {"em_open": "em_close", "strong_open": "strong_close", "s_open": "s_close", "link_open": "link_close"}


def _escape(text: str) -> str:
    return _SYNTAX.sub(r"\\\1", text)


def _link_end(attrs: dict) -> str:
    title = attrs.get("title")
    return "](" + str(attrs.get("href", "")) + (f' "{title}"' if title else "") + ")"


def _nodes(children: list, hard_break: str) -> list[Node]:
    root: list[Node] = []
    stack = [root]
    html_open: list[tuple[Group, int]] = []
    for tok in children:
        t = tok.type
        if t in ("text", "text_special"):
            stack[-1].append(tok.content)
        elif t == "softbreak":
            stack[-1].append(" ")
        elif t == "hardbreak":
            stack[-1].append(Piece(hard_break, breaks=True))
        elif t == "link_open" and tok.markup == "autolink":
            stack[-1].append(Piece("<" + str(tok.attrs.get("href", "")).removeprefix("mailto:") + ">"))
            stack.append([])  # its text is in the piece
        elif t in _PAIRS:
            opener, closer = ("[", _link_end(tok.attrs)) if t == "link_open" else (tok.markup, tok.markup)
            group = Group((opener, closer))
            stack[-1].append(group)
            stack.append(group.children)
        elif t.endswith("_close"):
            if len(stack) > 1:
                stack.pop()
        elif t == "code_inline":
            fence = tok.markup
            pad = " " if tok.content.startswith("`") or tok.content.endswith("`") else ""
            stack[-1].append(Piece(f"{fence}{pad}{tok.content}{pad}{fence}"))
        elif t == "image":
            title = tok.attrs.get("title")
            src = str(tok.attrs.get("src", "")) + (f' "{title}"' if title else "")
            stack[-1].append(Piece(f"![{tok.content}]({src})"))
        elif t == "html_inline" and (m := _OPEN_TAG.fullmatch(tok.content)) \
                and m.group(1).lower() not in VOID_TAGS:
            group = Group((tok.content, f"</{m.group(1)}>"))  # a tag pair wraps its words like emphasis
            stack[-1].append(group)
            stack.append(group.children)
            html_open.append((group, len(stack)))
        elif t == "html_inline" and html_open and tok.content == html_open[-1][0].payload[1] \
                and len(stack) == html_open[-1][1]:
            html_open.pop()
            stack.pop()
        else:  # other inline HTML (a void or unpaired tag, a comment): as written
            stack[-1].append(Piece(tok.content))
    for group, _ in reversed(html_open):  # never closed in this paragraph: the open tag alone, as written
        parent = _parent_of(root, group)
        i = parent.index(group)
        parent[i: i + 1] = [Piece(group.payload[0]), *group.children]
    return root


def _parent_of(nodes: list[Node], target: Group) -> list[Node]:
    for n in nodes:
        if n is target:
            return nodes
        if isinstance(n, Group):
            found = _parent_of(n.children, target)
            if found is not None:
                return found
    return None


def _write(nodes: list[Node]) -> str:
    out = []
    for n in nodes:
        if isinstance(n, str):
            out.append(_escape(n))
        elif isinstance(n, Group):
            out.append(n.payload[0] + _write(n.children) + n.payload[1])
        else:
            out.append(n.payload)
    return "".join(out)


def read_markdown(data: bytes) -> FileDocument:
    text = decode_text(data, ".md")
    md = MarkdownIt("commonmark").enable(["table", "strikethrough"]).disable("text_join")
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    cursor: dict[int, int] = {}  # per line, where the last found inline content ended (table cells share one)
    regions: list[tuple[int, int, Paragraph]] = []
    for tok in md.parse(text):
        if tok.type != "inline" or tok.map is None or not tok.content.strip():
            continue
        found = []
        for i, content_line in enumerate(tok.content.split("\n")):
            n = tok.map[0] + i
            if n >= len(lines):
                break
            at = lines[n].find(content_line.strip(), cursor.get(n, 0))
            if at < 0:
                break
            found.append((n, at, at + len(content_line.strip())))
            cursor[n] = at + len(content_line.strip())
        if not found:
            continue
        (first, col, _), (last, _, end) = found[0], found[-1]
        prefix = lines[found[1][0]][: found[1][1]] if len(found) > 1 else ""
        paragraph = to_block(_nodes(tok.children or [], "\\\n" + prefix))
        if paragraph is not None:
            regions.append((starts[first] + col, starts[last] + end, paragraph))
    if not regions:
        raise FileRefused("the file holds no text to translate", "empty_input")
    parts: list = []
    pos = 0
    for start, end, paragraph in regions:
        parts += [text[pos:start], paragraph.block]
        pos = end
    parts.append(text[pos:])
    markup = Markup([p for p in parts if p != ""])

    def write(rendered: list[str]) -> bytes:
        blocks = iter(_write(from_rendered(r, p)) for r, (_, _, p) in zip(rendered, regions, strict=True))
        return encoded("".join(p if isinstance(p, str) else next(blocks) for p in markup.parts), data)

    return FileDocument(markup, no_escape, write, charset("text/markdown", data))
