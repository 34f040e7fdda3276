//! The `tool-parser-grammar-plugin` world's bindings, in a crate of their own: wit-bindgen names
//! each interface's export macro after the interface and exports it at the crate root, so the
//! `tool-parser` export of this world and of `tool-parser-plugin` (in `k3-plugin-sdk`) cannot
//! share one crate. Use it through `k3_plugin_sdk::export_tool_parser_with_grammar!`.

#[cfg(target_arch = "wasm32")]
pub mod world {
    wit_bindgen::generate!({
        path: "../../../wit/v0.3",
        world: "tool-parser-grammar-plugin",
        pub_export_macro: true,
        export_macro_name: "__export_tool_grammar_world",
        default_bindings_module: "k3_plugin_sdk::bindings::tools_grammar",
    });
}
