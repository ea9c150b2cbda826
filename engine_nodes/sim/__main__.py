"""``python -m engine_nodes.sim --model chat-7b --port 8001 ...``"""

from engine_nodes.sim.cli import main

main()
