from fastdata.cli import main

main()
