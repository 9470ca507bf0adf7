"""Files of every format the file API takes, built with each format's own library, with formatting on some
words: `build(fmt, sentences, marked)` writes the sentences (lists of words) with the words at `marked`
(sentence, word) in bold (italics in subtitles), or, where `marked` maps them to a kind, kind "a" so and kind "b"
in italics (bold in subtitles), so that two runs of different formatting can stand side by side;
`read_back(fmt, data, kind)` opens a file with the same library and gives its paragraphs' text and the text of
each stretch of that kind."""

from __future__ import annotations

import io
import re
import zipfile

from PIL import Image

FORMATS = ("txt", "md", "html", "srt", "vtt", "docx", "pptx", "odt", "odp", "epub")


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


Kind = str | None  # None: unformatted; "a": bold (italics in subtitles); "b": italics (bold in subtitles)


def _runs(words: list[str], marks: dict[int, str]) -> list[tuple[str, Kind]]:
    """Consecutive words as runs (text, kind); the space between an unformatted run and a formatted one is
    unformatted, the space between two formatted runs of different kinds opens the second."""
    runs: list[tuple[str, Kind]] = []
    for i, w in enumerate(words):
        kind = marks.get(i)
        if runs and runs[-1][1] == kind:
            runs[-1] = (runs[-1][0] + " " + w, kind)
        elif not i:
            runs.append((w, kind))
        elif kind is None:
            runs.append((" " + w, None))
        elif runs[-1][1] is None:
            runs[-1] = (runs[-1][0] + " ", None)
            runs.append((w, kind))
        else:  # side by side with a run of another kind: the space opens this one
            runs.append((" " + w, kind))
    return runs


def build(fmt: str, sentences: list[list[str]], marked: set[tuple[int, int]] | dict[tuple[int, int], str]) -> bytes:
    kinds = marked if isinstance(marked, dict) else dict.fromkeys(marked, "a")
    marks = [{w: k for (s, w), k in kinds.items() if s == i} for i in range(len(sentences))]
    paras = [_runs(words, m) for words, m in zip(sentences, marks, strict=True)]
    return BUILDERS[fmt](paras)


def _inline(paras, tags: dict[str, tuple[str, str]], space_outside: bool = False) -> list[str]:
    """Each paragraph's runs between their tags; with `space_outside` (Markdown, where emphasis cannot open on a
    space) a run's opening space before its tag."""
    def run(text: str, kind: Kind) -> str:
        if not kind:
            return text
        lead = " " if space_outside and text.startswith(" ") else ""
        return f"{lead}{tags[kind][0]}{text[len(lead):]}{tags[kind][1]}"

    return ["".join(run(t, k) for t, k in p) for p in paras]


HTML_TAGS = {"a": ("<b>", "</b>"), "b": ("<i>", "</i>")}
SUBTITLE_TAGS = {"a": ("<i>", "</i>"), "b": ("<b>", "</b>")}


def _txt(paras) -> bytes:
    return ("\n\n".join(_inline(paras, {"a": ("", ""), "b": ("", "")})) + "\n").encode()


def _md(paras) -> bytes:
    body = "\n\n".join(_inline(paras, {"a": ("**", "**"), "b": ("_", "_")}, space_outside=True))
    return f"{body}\n\n```\ncode stays\n```\n".encode()


def _html(paras) -> bytes:
    body = "\n".join(f"<p>{p}</p>" for p in _inline(paras, HTML_TAGS))
    return f"<!doctype html>\n<html><body>\n{body}\n<pre>code stays</pre>\n</body></html>\n".encode()


def _srt(paras) -> bytes:
    cues = [f"{i + 1}\n00:00:{i:02d},000 --> 00:00:{i:02d},900\n{p}\n" for i, p in enumerate(_inline(paras, SUBTITLE_TAGS))]
    return "\n".join(cues).encode()


def _vtt(paras) -> bytes:
    cues = [f"c{i}\n00:{i:02d}.000 --> 00:{i:02d}.900 align:start\n{p}\n" for i, p in enumerate(_inline(paras, SUBTITLE_TAGS))]
    return ("WEBVTT\n\nNOTE kept as it is\n\n" + "\n".join(cues)).encode()


def _docx(paras) -> bytes:
    import docx

    d = docx.Document()
    d.core_properties.title = "".join(t for t, _ in paras[0])
    for p in paras:
        para = d.add_paragraph()
        for text, kind in p:
            run = para.add_run(text)
            run.bold, run.italic = (kind == "a") or None, (kind == "b") or None
    pic = io.BytesIO(png())
    d.add_picture(pic)
    d.sections[0].header.paragraphs[0].text = "".join(t for t, _ in paras[-1]).strip()
    table = d.add_table(rows=1, cols=1)
    table.cell(0, 0).text = "".join(t for t, _ in paras[0]).strip()
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def _pptx(paras) -> bytes:
    from pptx import Presentation
    from pptx.util import Inches

    prs = Presentation()
    slide = prs.slides.add_slide(prs.slide_layouts[5])
    slide.shapes.title.text = "".join(t for t, _ in paras[0]).strip()
    box = slide.shapes.add_textbox(Inches(1), Inches(2), Inches(6), Inches(3)).text_frame
    for i, p in enumerate(paras):
        para = box.paragraphs[0] if i == 0 else box.add_paragraph()
        for text, kind in p:
            run = para.add_run()
            run.text = text
            run.font.bold, run.font.italic = (kind == "a") or None, (kind == "b") or None
    slide.shapes.add_picture(io.BytesIO(png()), Inches(0), Inches(0))
    slide.notes_slide.notes_text_frame.text = "".join(t for t, _ in paras[-1]).strip()
    out = io.BytesIO()
    prs.save(out)
    return out.getvalue()


def _odf(paras, presentation: bool) -> bytes:
    from odf.draw import Frame, Page, TextBox
    from odf.opendocument import OpenDocumentPresentation, OpenDocumentText
    from odf.style import MasterPage, PageLayout, Style, TextProperties
    from odf.text import P, Span

    doc = OpenDocumentPresentation() if presentation else OpenDocumentText()
    styles = {"a": Style(name="Strong", family="text"), "b": Style(name="Emphasis", family="text")}
    styles["a"].addElement(TextProperties(fontweight="bold"))
    styles["b"].addElement(TextProperties(fontstyle="italic"))
    for style in styles.values():
        doc.automaticstyles.addElement(style)
    elements = []
    for p in paras:
        para = P()
        for text, kind in p:
            if kind:
                para.addElement(Span(stylename=styles[kind], text=text))
            else:
                para.addText(text)
        elements.append(para)
    if presentation:
        layout = PageLayout(name="PL")
        doc.automaticstyles.addElement(layout)
        master = MasterPage(name="Default", pagelayoutname=layout)
        doc.masterstyles.addElement(master)
        page = Page(masterpagename=master)
        frame = Frame(width="20cm", height="10cm", x="1cm", y="1cm")
        box = TextBox()
        for e in elements:
            box.addElement(e)
        frame.addElement(box)
        page.addElement(frame)
        doc.presentation.addElement(page)
    else:
        for e in elements:
            doc.text.addElement(e)
    doc.addPicture("Pictures/dot.png", "image/png", png())
    out = io.BytesIO()
    doc.save(out)
    return out.getvalue()


def _epub(paras) -> bytes:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("id-1")
    book.set_title("".join(t for t, _ in paras[0]).strip())
    book.set_language("en")
    chapter = epub.EpubHtml(title="one", file_name="one.xhtml", lang="en")
    chapter.content = "<html><body>" + "".join(f"<p>{p}</p>" for p in _inline(paras, HTML_TAGS)) + "</body></html>"
    book.add_item(chapter)
    book.add_item(epub.EpubItem(uid="dot", file_name="dot.png", media_type="image/png", content=png()))
    book.toc = [chapter]
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", chapter]
    out = io.BytesIO()
    epub.write_epub(out, book)
    return out.getvalue()


BUILDERS = {"txt": _txt, "md": _md, "html": _html, "srt": _srt, "vtt": _vtt, "docx": _docx, "pptx": _pptx,
            "odt": lambda p: _odf(p, False), "odp": lambda p: _odf(p, True), "epub": _epub}


def read_back(fmt: str, data: bytes, kind: str = "a") -> tuple[list[str], list[str]]:
    """(each body paragraph's text, the text of each stretch of formatting `kind`) of a file, read by its own
    library."""
    if fmt in ("txt",):
        return [p.strip() for p in data.decode().split("\n\n") if p.strip()], []
    if fmt == "md":
        text = data.decode().split("```")[0]
        marked = re.findall(r"\*\*(.+?)\*\*", text) if kind == "a" else re.findall(r"(?<!\w)_(.+?)_(?!\w)", text)
        return [re.sub(r"\*\*|(?<!\w)_|_(?!\w)", "", p) for p in text.split("\n\n") if p.strip()], marked
    if fmt in ("html", "epub"):
        if fmt == "epub":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                page = z.read(next(n for n in z.namelist() if n.endswith("one.xhtml"))).decode()
        else:
            page = data.decode()
        paras = re.findall(r"<p>(.*?)</p>", page, re.S)
        tag = HTML_TAGS[kind][0][1:-1]
        return [re.sub(r"<[^>]+>", "", p) for p in paras], re.findall(rf"<{tag}>(.*?)</{tag}>", page)
    if fmt in ("srt", "vtt"):
        import srt
        import webvtt

        if fmt == "srt":
            cues = [c.content for c in srt.parse(data.decode())]
        else:
            cues = [c.raw_text for c in webvtt.from_buffer(io.StringIO(data.decode()))]
        return [re.sub(r"<[^>]+>", "", c).replace("\n", " ") for c in cues], \
            [m for c in cues for m in re.findall(rf"<{SUBTITLE_TAGS[kind][0][1:-1]}>(.*?)</", c, re.S)]
    if fmt == "docx":
        import docx

        d = docx.Document(io.BytesIO(data))
        paras = [p for p in d.paragraphs if p.text.strip()]
        return [p.text for p in paras], [r.text for p in paras for r in p.runs if (r.bold if kind == "a" else r.italic)]
    if fmt == "pptx":
        from pptx import Presentation

        box = [s for s in Presentation(io.BytesIO(data)).slides[0].shapes if s.has_text_frame][1].text_frame
        return [p.text for p in box.paragraphs], [r.text for p in box.paragraphs for r in p.runs
                                                  if (r.font.bold if kind == "a" else r.font.italic)]
    if fmt in ("odt", "odp"):
        from odf import teletype
        from odf.opendocument import load
        from odf.text import P, Span

        doc = load(io.BytesIO(data))
        style = {"a": "Strong", "b": "Emphasis"}[kind]
        return [teletype.extractText(p) for p in doc.getElementsByType(P)], \
            [teletype.extractText(s) for s in doc.getElementsByType(Span) if s.getAttribute("stylename") == style]
    raise ValueError(fmt)
