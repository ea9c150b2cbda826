"""``python -m simengine --model chat-7b --port 8001 ...``"""

from simengine.cli import main

main()
