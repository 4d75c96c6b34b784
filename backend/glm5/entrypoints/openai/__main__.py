"""``python -m glm5.entrypoints.openai``: the OpenAI-compatible server (see :mod:`.app`)."""

import sys

from glm5.entrypoints.openai.app import main

if __name__ == "__main__":
    sys.exit(main())
