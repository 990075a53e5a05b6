# placeholder until `make generate` writes the index
