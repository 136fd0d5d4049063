"""`python -m draftlab.server`, the reference server's short name: draftlab.engine.server."""
if __name__ == "__main__":
    from draftlab.engine.server import main

    main()
