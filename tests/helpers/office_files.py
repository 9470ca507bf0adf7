"""Files of every format the file API takes, built with each format's own library, with formatting on some
words: `build(fmt, sentences, marked)` writes the sentences (lists of words) with the words at `marked`
(sentence, word) in bold (a link in Markdown and HTML, italics in subtitles); `read_back(fmt, data)` opens a
file with the same library and gives its paragraphs' text and the marked words' text."""

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


def _runs(words: list[str], marked: set[int]) -> list[tuple[str, bool]]:
    """Consecutive words as runs (text, marked); the spaces between a marked run and the rest are unmarked."""
    runs: list[tuple[str, bool]] = []
    for i, w in enumerate(words):
        m = i in marked
        if runs and runs[-1][1] == m:
            runs[-1] = (runs[-1][0] + " " + w, m)
        elif i and m:
            runs[-1] = (runs[-1][0] + " ", False)
            runs.append((w, m))
        else:
            runs.append(((" " if i else "") + w, m))
    return runs


def build(fmt: str, sentences: list[list[str]], marked: set[tuple[int, int]]) -> bytes:
    marks = [{w for s, w in marked if s == i} for i in range(len(sentences))]
    paras = [_runs(words, m) for words, m in zip(sentences, marks, strict=True)]
    return BUILDERS[fmt](paras)


def _inline(paras, open_: str, close: str) -> list[str]:
    return ["".join(f"{open_}{t}{close}" if m else t for t, m in p) for p in paras]


def _txt(paras) -> bytes:
    return ("\n\n".join(_inline(paras, "", "")) + "\n").encode()


def _md(paras) -> bytes:
    body = "\n\n".join(_inline(paras, "**", "**"))
    return f"{body}\n\n```\ncode stays\n```\n".encode()


def _html(paras) -> bytes:
    body = "\n".join(f"<p>{p}</p>" for p in _inline(paras, "<b>", "</b>"))
    return f"<!doctype html>\n<html><body>\n{body}\n<pre>code stays</pre>\n</body></html>\n".encode()


def _srt(paras) -> bytes:
    cues = [f"{i + 1}\n00:00:{i:02d},000 --> 00:00:{i:02d},900\n{p}\n" for i, p in enumerate(_inline(paras, "<i>", "</i>"))]
    return "\n".join(cues).encode()


def _vtt(paras) -> bytes:
    cues = [f"c{i}\n00:{i:02d}.000 --> 00:{i:02d}.900 align:start\n{p}\n" for i, p in enumerate(_inline(paras, "<i>", "</i>"))]
    return ("WEBVTT\n\nNOTE kept as it is\n\n" + "\n".join(cues)).encode()


def _docx(paras) -> bytes:
    import docx

    d = docx.Document()
    d.core_properties.title = "".join(t for t, _ in paras[0])
    for p in paras:
        para = d.add_paragraph()
        for text, m in p:
            para.add_run(text).bold = m or None
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
        for text, m in p:
            run = para.add_run()
            run.text = text
            run.font.bold = m or None
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
    bold = Style(name="Strong", family="text")
    bold.addElement(TextProperties(fontweight="bold"))
    doc.automaticstyles.addElement(bold)
    elements = []
    for p in paras:
        para = P()
        for text, m in p:
            if m:
                para.addElement(Span(stylename=bold, text=text))
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
    chapter.content = "<html><body>" + "".join(f"<p>{p}</p>" for p in _inline(paras, "<b>", "</b>")) + "</body></html>"
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


def read_back(fmt: str, data: bytes) -> tuple[list[str], list[str]]:
    """(each body paragraph's text, the text of each marked stretch) of a file, read by its own library."""
    if fmt in ("txt",):
        return [p.strip() for p in data.decode().split("\n\n") if p.strip()], []
    if fmt == "md":
        text = data.decode().split("```")[0]
        return [re.sub(r"\*\*", "", p) for p in text.split("\n\n") if p.strip()], re.findall(r"\*\*(.+?)\*\*", text)
    if fmt in ("html", "epub"):
        if fmt == "epub":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                page = z.read(next(n for n in z.namelist() if n.endswith("one.xhtml"))).decode()
        else:
            page = data.decode()
        paras = re.findall(r"<p>(.*?)</p>", page, re.S)
        return [re.sub(r"<[^>]+>", "", p) for p in paras], re.findall(r"<b>(.*?)</b>", page)
    if fmt in ("srt", "vtt"):
        import srt
        import webvtt

        if fmt == "srt":
            cues = [c.content for c in srt.parse(data.decode())]
        else:
            cues = [c.raw_text for c in webvtt.from_buffer(io.StringIO(data.decode()))]
        return [re.sub(r"<[^>]+>", "", c).replace("\n", " ") for c in cues], \
            [m for c in cues for m in re.findall(r"<i>(.*?)</i>", c, re.S)]
    if fmt == "docx":
        import docx

        d = docx.Document(io.BytesIO(data))
        paras = [p for p in d.paragraphs if p.text.strip()]
        return [p.text for p in paras], [r.text for p in paras for r in p.runs if r.bold]
    if fmt == "pptx":
        from pptx import Presentation

        box = [s for s in Presentation(io.BytesIO(data)).slides[0].shapes if s.has_text_frame][1].text_frame
        return [p.text for p in box.paragraphs], [r.text for p in box.paragraphs for r in p.runs if r.font.bold]
    if fmt in ("odt", "odp"):
        from odf import teletype
        from odf.opendocument import load
        from odf.text import P, Span

        doc = load(io.BytesIO(data))
        return [teletype.extractText(p) for p in doc.getElementsByType(P)], \
            [teletype.extractText(s) for s in doc.getElementsByType(Span)]
    raise ValueError(fmt)
