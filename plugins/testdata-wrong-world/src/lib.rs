//! TEST ONLY. A well-formed component exporting an unrelated interface: loading it into any
//! stage must be refused at type-check time.

#[cfg(target_arch = "wasm32")]
mod component {
    wit_bindgen::generate!({
        inline: "package k3serve-test:other@0.1.0;
                 interface greeter { greet: func(name: string) -> string; }
                 world other { export greeter; }",
    });

    struct Greeter;

    impl exports::k3serve_test::other::greeter::Guest for Greeter {
        fn greet(name: String) -> String {
            format!("hello {name}")
        }
    }

    export!(Greeter);
}
