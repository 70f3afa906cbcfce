"""``python -m zephon.tools.synth [style]``: print two documents of a style, for a look."""

import sys

from .text import generate_documents

if __name__ == "__main__":  # pragma: no cover - manual look at the output
    style = sys.argv[1] if len(sys.argv) > 1 else "web"
    for doc in generate_documents(style, 2, 0):
        print(doc[:1500])
        print("=" * 80)
