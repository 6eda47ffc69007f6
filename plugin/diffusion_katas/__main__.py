"""`python -m diffusion_katas ...` is `kata ...`."""
import sys

from diffusion_katas.commands.main import main

sys.exit(main())
