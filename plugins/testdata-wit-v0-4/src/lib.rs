//! TEST ONLY. Exports `k3serve:plugin/tool-parser@0.4.0`: a host serving 0.1 to 0.3 must refuse
//! it by version, not with a confusing type error.

#[cfg(target_arch = "wasm32")]
mod component {
    wit_bindgen::generate!({
        inline: "package k3serve:plugin@0.4.0;
                 interface tool-parser { ping: func() -> string; }
                 world tool-parser-plugin { export tool-parser; }",
    });

    struct Future;

    impl exports::k3serve::plugin::tool_parser::Guest for Future {
        fn ping() -> String {
            "0.4".into()
        }
    }

    export!(Future);
}
