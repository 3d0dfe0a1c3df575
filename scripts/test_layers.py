"""Tests of the layering check (scripts/layers.py) on small made-up crates: it must report an
upward import, a circle and a file outside every layer, and pass a crate that has none of them.
Run by scripts/test: `python3 scripts/test_layers.py`."""

import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import layers  # noqa: E402

TABLE = [
    {"name": "data", "modules": ["message"]},
    {"name": "queue", "modules": ["queue"]},
    {"name": "routing", "modules": ["routing"]},
]


class LayersTest(unittest.TestCase):
    def crate(self, files: dict) -> list:
        with tempfile.TemporaryDirectory() as root:
            src = Path(root) / "src"
            for path, text in files.items():
                f = src / path
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            saved = layers.ROOT
            layers.ROOT = Path(root)
            try:
                return layers.check_crate("t", {"src": "src", "layers": TABLE}, False)
            finally:
                layers.ROOT = saved

    BASE = {
        "lib.rs": "pub mod message; pub mod queue; pub mod routing;\n",
        "message.rs": "pub struct Message;\n",
        "queue/mod.rs": "pub mod publish;\nuse crate::message::Message;\npub struct Queue;\n",
        "queue/publish.rs": "use super::Queue;\nuse crate::message::Message;\n",
        "routing/mod.rs": "use crate::queue::{Queue, publish};\n",
    }

    def test_a_layered_crate_passes(self):
        self.assertEqual(self.crate(self.BASE), [])

    def test_an_upward_import_is_reported(self):
        files = dict(self.BASE)
        files["queue/publish.rs"] += "fn f(_: &crate::routing::Vhost) {}\n"
        problems = self.crate(files)
        self.assertTrue(any("queue::publish (layer queue) imports routing" in p for p in problems), problems)

    def test_an_upward_import_in_a_comment_is_not(self):
        files = dict(self.BASE)
        files["queue/publish.rs"] += "// see crate::routing::Vhost\n/// [`crate::routing`]\n"
        self.assertEqual(self.crate(files), [])

    def test_a_circle_within_a_layer_is_reported(self):
        files = dict(self.BASE)
        files["queue/mod.rs"] += "pub mod consume;\n"
        files["queue/consume.rs"] = "use crate::queue::publish::x;\n"
        files["queue/publish.rs"] += "use crate::queue::consume::y;\n"
        problems = self.crate(files)
        self.assertTrue(any("import circle among 2 files" in p for p in problems), problems)

    def test_a_circle_through_a_relative_path_is_reported(self):
        # routing -> routing::helper is written `helper::x`, without crate:: or super::
        files = {
            "lib.rs": "pub mod a; pub mod routing;\n",
            "a.rs": "use crate::routing::Y;\n",
            "routing/mod.rs": "mod helper;\npub struct Y;\nfn f() { helper::x(); }\n",
            "routing/helper.rs": "use crate::a::Z;\npub fn x() {}\n",
        }
        with tempfile.TemporaryDirectory() as root:
            src = Path(root) / "src"
            for path, text in files.items():
                f = src / path
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            saved = layers.ROOT
            layers.ROOT = Path(root)
            try:
                problems = layers.check_crate("t", {"src": "src"}, False)
            finally:
                layers.ROOT = saved
        self.assertTrue(any("import circle among 3 files" in p for p in problems), problems)

    def test_a_file_in_no_layer_is_reported(self):
        files = dict(self.BASE)
        files["lib.rs"] += "pub mod stray;\n"
        files["stray.rs"] = "\n"
        problems = self.crate(files)
        self.assertTrue(any("stray.rs is in no layer" in p for p in problems), problems)


if __name__ == "__main__":
    unittest.main()
