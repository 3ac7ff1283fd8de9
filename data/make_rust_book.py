"""Make data/rust_book.jsonl: the prose of a few chapters of "The Rust Programming Language" (Steve Klabnik,
Carol Nichols and the Rust community; MIT OR Apache-2.0, see data/LICENSE-rust-book), read from the HTML
copy that ships with a Rust toolchain's docs:

    python data/make_rust_book.py ~/.rustup/toolchains/stable-x86_64-unknown-linux-gnu/share/doc/rust/html/book

Headings, paragraphs and list items are kept, one per line; code listings and the page chrome are not.
"""
import json
import sys
from html.parser import HTMLParser
from pathlib import Path

CHAPTERS = ["ch04-01-what-is-ownership", "ch08-02-strings", "ch10-02-traits", "ch15-05-interior-mutability",
            "ch17-01-futures-and-syntax", "ch09-03-to-panic-or-not-to-panic"]  # 2,677-4,547 SmolLM2 tokens each
KEEP = {"h1", "h2", "h3", "p", "li"}


class Prose(HTMLParser):
    """The text of <main>'s headings, paragraphs and list items, outside <pre> blocks."""

    def __init__(self):
        super().__init__()
        self.blocks, self.open, self.in_main, self.in_pre = [], None, False, 0

    def handle_starttag(self, tag, attrs):
        self.in_main |= tag == "main"
        self.in_pre += tag == "pre"
        if self.in_main and not self.in_pre and tag in KEEP and self.open is None:
            self.open = (tag, [])

    def handle_endtag(self, tag):
        self.in_pre -= tag == "pre"
        if self.open and tag == self.open[0]:
            text = " ".join("".join(self.open[1]).split())
            if text:
                self.blocks.append(text)
            self.open = None
        self.in_main &= tag != "main"

    def handle_data(self, data):
        if self.open and not self.in_pre:
            self.open[1].append(data)


def main(book: str):
    with open(Path(__file__).with_name("rust_book.jsonl"), "w") as out:
        for name in CHAPTERS:
            parser = Prose()
            parser.feed((Path(book) / f"{name}.html").read_text(encoding="utf-8"))
            out.write(json.dumps({"title": name, "text": "\n".join(parser.blocks)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
