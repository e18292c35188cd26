import sys

from . import main, options

options.parser().parse_args(sys.argv[1:])  # --help and a mistyped option answer before run.py's imports
main(sys.argv[1:])
